"""Entry point of corerun-structured-output: registers the ``xgrammar`` logits processor (imports no torch)."""

from corerun import LogitsProcessorCapabilities, hookimpl

# The one declaration of what ``xgrammar`` serves; ``XGrammarProcessor.capabilities`` is this object.
# apply() fills the token bitmask on the host and copies it to the device: no device-to-host sync.
CAPABILITIES = LogitsProcessorCapabilities(params=frozenset({"structured_outputs"}), host_sync=False)


@hookimpl
def corerun_logits_processors(register):
    register(
        "xgrammar",
        "corerun_structured_output.processor:XGrammarProcessor",
        capabilities=CAPABILITIES,
        priority=10,
        description="JSON schema, JSON object, regex, choice and EBNF grammars as token bitmasks (xgrammar)",
    )

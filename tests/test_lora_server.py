"""``corerun serve`` with LoRA adapters: served as models with the base as parent, routed by ``model``,
loaded and unloaded at run time behind the switch and the API key."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("peft")
pytest.importorskip("fastapi")

from corerun import LoRARequest  # noqa: E402
from corerun.testing.engines import make_llm  # noqa: E402
from tests.helpers.serving import SERVING, running_server, tiny_chat_model  # noqa: E402
from tests.test_lora_engine import _adapter  # noqa: E402

KEY = "lora-test-key"
PROMPT = [5, 17, 99, 3, 41, 7, 230, 12, 9]


def _call(url: str, body=None, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers,
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.timeout(180)
def test_adapters_are_models_routed_by_name_and_loaded_at_run_time_behind_the_key(tmp_path):
    base = tiny_chat_model(tmp_path)
    first, _ = _adapter(base, tmp_path, 1, 4, 8, False, ["q_proj", "v_proj", "down_proj"])
    second, _ = _adapter(base, tmp_path, 2, 8, 16, True, ["k_proj", "gate_proj", "o_proj"])
    llm = make_llm(base, **SERVING, lora={"enabled": True, "max_loras": 2, "max_lora_rank": 8},
                   server={"api_key": KEY, "served_model_name": "base", "lora_modules": {"first": str(first)},
                           "enable_lora_runtime_updating": True})
    greedy = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    want = {name: llm.generate([PROMPT], {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True},
                               lora_request=lora)[0].outputs[0].text
            for name, lora in (("base", None), ("first", LoRARequest("x", 101, str(first))),
                               ("second", LoRARequest("y", 102, str(second))))}
    assert len(set(want.values())) == 3  # each adapter changes the text
    with running_server(llm) as url:
        status, models = _call(url + "/v1/models")
        assert status == 200 and [(m["id"], m.get("parent")) for m in models["data"]] == [("base", None), ("first", "base")]
        for name in ("base", "first"):
            status, out = _call(url + "/v1/completions", {**greedy, "model": name})
            assert status == 200 and out["choices"][0]["text"] == want[name], name
        status, err = _call(url + "/v1/completions", {**greedy, "model": "second"})
        assert status == 404 and "'second' does not exist" in err["error"]["message"]

        load = {"lora_name": "second", "lora_path": str(second)}
        assert _call(url + "/v1/load_lora_adapter", load, key=None)[0] == 401  # behind the API key
        status, err = _call(url + "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path / "none")})
        assert status == 400 and "is not a folder" in err["error"]["message"]
        assert _call(url + "/v1/load_lora_adapter", load)[0] == 200
        status, out = _call(url + "/v1/completions", {**greedy, "model": "second"})
        assert status == 200 and out["choices"][0]["text"] == want["second"]
        assert _call(url + "/v1/unload_lora_adapter", {"lora_name": "second"})[0] == 200
        assert [m["id"] for m in _call(url + "/v1/models")[1]["data"]] == ["base", "first"]
        assert _call(url + "/v1/completions", {**greedy, "model": "second"})[0] == 404

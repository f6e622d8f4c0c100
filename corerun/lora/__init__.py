"""Multi-LoRA serving: adapters read from PEFT folders, a host cache, device slots and the kernels
that add each token's adapter to the targeted linear layers (docs/lora.md)."""

"""The cann target's passes (``targets = ("cann",)``): lower standard ops into what the NPU runs best."""

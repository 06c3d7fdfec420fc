"""Target lowering passes (``targets = ("cann",)``): rewrite standard ops into what the target runs best."""

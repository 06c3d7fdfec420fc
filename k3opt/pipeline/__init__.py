"""The run's machinery: the pass API and registry (``pass_base``), the pass manager (``manager``) and
verification of the optimized model against the original (``verify``, ``verify_dims``)."""

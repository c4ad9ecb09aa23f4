"""Export to and import from the layouts serving engines load (speculators for vLLM, SGLang/EAGLE native), and
`doctor`, which checks a drafter directory against the target it will be served with."""

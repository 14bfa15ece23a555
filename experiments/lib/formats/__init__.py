"""The formats serving engines load drafters from (vLLM 0.32, speculators 0.9), one module each, written and read.

eagle3.py    speculators' EAGLE-3 (a prophet, arch=eagle3; SGLang's / SpecForge's layout read as it)
eagle.py     vLLM's EAGLE-1 (a prophet, arch=eagle)
medusa.py    vLLM's Medusa (Medusa heads)
llama.py     a plain Hugging Face Llama (a draft model, arch=llama): written, and read back only to check it
common.py    what they share: which format a directory holds, the one-layer Llama config and its tensors
registry.py  one call per direction: write(fmt, ...), read(directory, ...), check_served(path, ...)
"""

"""What the compiler and the runtime both need, and nothing else: error classes, the artifact
manifest reader, the safetensors header reader and the PEFT LoRA reader. It imports neither of
them, so a compiled artifact is served by ``infeng_runtime`` plus this package alone."""

"""kvcomm: KV-cache reuse, re-rotation, quantization and blending between agents."""

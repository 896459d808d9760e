"""Start-up: loading, calibrating a quantized KV cache, warming up (and compiling the rest in
the background), the compilation cache and the warm-up's progress."""

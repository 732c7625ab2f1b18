"""Reading and writing weights: the floor above the model's computation.

    load.py       `mdjax.load`: a name, a directory or a file -> a `Model`
    registry.py   the names mdjax knows (random built-ins, shipped models, real GGUF models)
    hf.py         Hugging Face-format directories: config.json + safetensors, read and written
    hf_layout.py  HF tensor names <-> mdjax's params (fused projections, stacked layers)
    gguf.py       GGUF files (llama.cpp's format), through the `gguf` package
    gguf_blocks.py  ggml's quantized blocks read as integers, scales and offsets
    gguf_native.py  `quantize="gguf"`: a GGUF's matrices kept as its blocks
    quantized_layout.py  a quantized model's params as named tensors (`save_hf`) and back
    lazy.py       weights as recipes over checkpoint tensors, read only in the slices a
                  process's devices hold (loading onto a mesh)

The forward pass (`mdjax.models`), the cache and the sharding rules never import this
package; it imports them (the `Model` it builds, the layout it places weights by).
"""

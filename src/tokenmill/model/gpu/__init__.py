"""The CUDA side of the model runner: loading GGUF weights onto the device (load.py), the batch
metadata that the device attention kernels read (batch.py), decode steps as CUDA graphs in batch-size
buckets (buckets.py: the device-independent part; graphs.py: capture and replay), and the KV cache's
share of GPU memory (memory.py). Everything here runs on CPU tensors too, with the kernels of
`tokenmill.kernels.gpu` falling back to their PyTorch references, except graph capture."""

"""The tensor-parallel layout (plain Python) and the parallel layers that slice checkpoint tensors."""

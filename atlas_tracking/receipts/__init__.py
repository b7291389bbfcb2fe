"""Pure receipt functions: tensors (or per-window numpy arrays) in, numbers out; no hooks, no I/O."""

"""Pure functions: tensors or arrays in, numbers out; no hooks, no I/O (the lowest layer).

One concept per module, each with a numpy-loop reference in the tests; the definitions are in
``docs/receipts.md``.
"""

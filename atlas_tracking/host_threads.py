"""Host-side statistics on one BLAS thread.

numpy's OpenBLAS keeps its worker threads spinning for a while after a multi-threaded call. On a
training host those threads then compete with the framework's own threads: on a 2-core machine a
forward pass right after a gate's bootstrap took twice as long. A gate's host products are small
(resamples x windows), so they run on the calling thread instead.

Example:
    >>> import numpy as np
    >>> @one_blas_thread
    ... def gram(a):
    ...     return a @ a.T
    >>> gram(np.eye(2)).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from threadpoolctl import ThreadpoolController

F = TypeVar("F", bound=Callable)


@functools.lru_cache(maxsize=1)
def _controller() -> ThreadpoolController:
    return ThreadpoolController()


def one_blas_thread(fn: F) -> F:
    """Run ``fn`` with every loaded BLAS library limited to one thread (restored afterwards)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _controller().limit(limits=1, user_api="blas"):
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]

"""Global state shared by recording and the engine.

`CTX` holds the hook handles `extend` registered, the stack of active `backpack(...)` engines
and the `disable()` depth. Client libraries import it (`from backpack.context import CTX`) to
remove every hook backpack registered.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:  # pragma: no cover
    from backpack.engine import Engine


class _GlobalContext:
    """Process-wide bookkeeping of backpack's hooks and active contexts."""

    def __init__(self) -> None:
        self.hook_handles: list[RemovableHandle] = []
        self.engines: list[Engine] = []
        self.disabled_depth: int = 0
        #: >0 while backpack itself re-runs modules (torch.func fallbacks): record nothing
        self.internal_depth: int = 0

    # --- hooks -------------------------------------------------------------------------------
    def add_hook_handle(self, handle: RemovableHandle) -> None:
        """Remember a hook handle so that `remove_hooks` can undo `extend`."""
        self.hook_handles.append(handle)

    def remove_hooks(self) -> None:
        """Remove every hook `extend` registered; extended models then behave as never extended."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []

    # --- active engine -----------------------------------------------------------------------
    @property
    def engine(self) -> Engine | None:
        """The innermost active `backpack(...)` engine, or None outside every context."""
        return self.engines[-1] if self.engines else None

    def is_extension_active(self, *extension_classes: type) -> bool:
        """Whether an extension of one of the given classes is active in the innermost context."""
        engine = self.engine
        if engine is None:
            return False
        return any(isinstance(ext, extension_classes) for ext in engine.extensions)

    def get_active_exts(self) -> list[Any]:
        """The extensions of the innermost active context (empty outside every context)."""
        engine = self.engine
        return list(engine.extensions) if engine is not None else []

    @contextmanager
    def internal(self) -> Iterator[None]:
        """Run backpack's own module calls without recording them."""
        self.internal_depth += 1
        try:
            yield
        finally:
            self.internal_depth -= 1

    @property
    def recording_disabled(self) -> bool:
        """Whether forwards currently run under `backpack.disable()`."""
        return self.disabled_depth > 0


CTX = _GlobalContext()

"""Process-wide state shared by recording and the engine, kept per thread where it must be.

`CTX` holds the modules `extend` hooked, the active `backpack(...)` engines and the `disable()`
depth. Engines and depths belong to the thread that entered them: two threads training two
models at once never see each other's contexts. Autograd runs hooks of a CPU backward on the
calling thread but those of a CUDA backward on its own device threads, so a hook looks up its
engine on the thread that ran it first and otherwise on the thread that ran the module's
forward (see `engine_for`). Client libraries import `CTX` (`from backpack.context import CTX`)
to remove every hook backpack registered.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


class Engine(Protocol):
    """What recording hands a backward to: the engine of an active `backpack(...)` context.

    Defined here, below recording, so that neither this module nor recording imports the
    engine (`backpack.engine.Engine` implements it).
    """

    extensions: list[Any]

    def on_module_backward(self, record: Any, grads: tuple[Tensor | None, ...]) -> None:
        """The gradients at a recorded call's outputs are known."""

    def on_module_output_part(
        self, record: Any, parts: list[tuple[int, Tensor | None]], nodes: int
    ) -> None:
        """The gradients at some outputs of a multi-output call are known."""


class _ThreadState(threading.local):
    """What one thread has entered: its engine stack and its disable/internal depths."""

    def __init__(self) -> None:
        self.engines: list[Engine] = []
        self.disabled_depth = 0
        #: >0 while backpack itself re-runs modules (torch.func fallbacks): record nothing
        self.internal_depth = 0
        #: >0 while the engine runs autograd itself (factor propagation): hooks do nothing
        self.propagating = 0


class _GlobalContext:
    """Process-wide bookkeeping of backpack's hooks and active contexts."""

    def __init__(self) -> None:
        self._local = _ThreadState()
        #: thread id -> that thread's engine stack (only threads with an active context)
        self._stacks: dict[int, list[Engine]] = {}
        #: extended modules -> their forward-hook handle; entries die with the module
        self._hooked: weakref.WeakKeyDictionary[nn.Module, RemovableHandle] = (
            weakref.WeakKeyDictionary()
        )
        #: handles registered without a module (kept until `remove_hooks`)
        self._anonymous: list[RemovableHandle] = []
        self._lock = threading.Lock()

    # --- hooks -------------------------------------------------------------------------------
    def add_hook_handle(self, handle: RemovableHandle, module: nn.Module | None = None) -> None:
        """Remember a hook handle so that `remove_hooks` can undo `extend`.

        Handles are kept per module and weakly: a dropped model leaves nothing behind.
        """
        with self._lock:
            if module is None:
                self._anonymous.append(handle)
            else:
                self._hooked[module] = handle

    @property
    def hook_handles(self) -> list[RemovableHandle]:
        """The handles of every live extended module."""
        with self._lock:
            return list(self._hooked.values()) + list(self._anonymous)

    def remove_hooks(self) -> None:
        """Remove every hook `extend` registered; extended models then behave as never extended."""
        with self._lock:
            items = list(self._hooked.items())
            anonymous, self._anonymous = self._anonymous, []
            self._hooked = weakref.WeakKeyDictionary()
        for module, handle in items:
            handle.remove()
            module.__dict__.pop("_backpack_extend", None)
        for handle in anonymous:
            handle.remove()

    # --- active engines ----------------------------------------------------------------------
    @property
    def engines(self) -> list[Engine]:
        """The calling thread's stack of active `backpack(...)` engines (innermost last)."""
        return self._local.engines

    def push_engine(self, engine: Engine) -> None:
        """Enter `engine` on the calling thread."""
        stack = self._local.engines
        stack.append(engine)
        with self._lock:
            self._stacks[threading.get_ident()] = stack

    def pop_engine(self, engine: Engine) -> None:
        """Leave `engine` on the calling thread (wherever it sits in the stack)."""
        stack = self._local.engines
        if engine in stack:
            stack.remove(engine)
        if not stack:
            with self._lock:
                self._stacks.pop(threading.get_ident(), None)

    @property
    def engine(self) -> Engine | None:
        """The calling thread's innermost active `backpack(...)` engine, or None."""
        stack = self._local.engines
        return stack[-1] if stack else None

    def hook_engine(self, forward_thread: int | None) -> Engine | None:
        """The engine a module hook hands its call to, or None (none active, or propagating).

        The hot path of every recorded call's backward: one thread-local lookup.
        """
        local = self._local
        if local.propagating:
            return None
        stack = local.engines
        if stack:
            return stack[-1]
        if not self._stacks or forward_thread is None:
            return None
        other = self._stacks.get(forward_thread)
        return other[-1] if other else None

    def engine_for(self, forward_thread: int | None) -> Engine | None:
        """The engine a hook belongs to: the running thread's, else the forward's thread's.

        CUDA backward passes run hooks on autograd's device threads, which never entered a
        context; the module's forward ran on the thread that owns the backward.
        """
        stack = self._local.engines
        if stack:
            return stack[-1]
        if forward_thread is None:
            return None
        other = self._stacks.get(forward_thread)
        return other[-1] if other else None

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

    # --- depths ------------------------------------------------------------------------------
    @property
    def disabled_depth(self) -> int:
        """How many `backpack.disable()` blocks the calling thread is in."""
        return self._local.disabled_depth

    @disabled_depth.setter
    def disabled_depth(self, value: int) -> None:
        self._local.disabled_depth = value

    @property
    def internal_depth(self) -> int:
        """>0 while backpack re-runs modules itself on the calling thread."""
        return self._local.internal_depth

    @contextmanager
    def internal(self) -> Iterator[None]:
        """Run backpack's own module calls without recording them."""
        self._local.internal_depth += 1
        try:
            yield
        finally:
            self._local.internal_depth -= 1

    @property
    def propagating(self) -> bool:
        """Whether the calling thread runs one of the engine's own backward passes."""
        return self._local.propagating > 0

    @contextmanager
    def propagation(self) -> Iterator[None]:
        """Mark the engine's own autograd calls: module hooks firing inside them do nothing."""
        self._local.propagating += 1
        try:
            yield
        finally:
            self._local.propagating -= 1

    @property
    def recording_disabled(self) -> bool:
        """Whether forwards currently run under `backpack.disable()`."""
        return self._local.disabled_depth > 0


CTX = _GlobalContext()

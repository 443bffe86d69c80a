"""Pytree handling on top of optree: one namespace, dataclasses without registration, key paths.

fdp never walks containers by hand. Every flatten goes through :func:`flatten`, which uses
optree in the ``"fdp"`` namespace (:data:`NAMESPACE`). optree's built-in containers are nodes,
and so are, from the first time one is seen:

* types a user registered with optree in any namespace (optree requires one; the registration
  is adopted in fdp's), and
* plain ``@dataclass`` instances, which optree treats as leaves: they are registered field by
  field, so users never have to register them and their fields are scattered like any other
  container's; not a ``torch.nn.Module`` written as a dataclass, which stays a leaf, as every
  module does.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import optree
import torch

__all__ = [
    "NAMESPACE",
    "flatten",
    "flatten_like",
    "LastStructure",
    "SpecCache",
    "same_structure",
    "replicas_agree",
    "has_keyed_containers",
    "unflatten",
    "refusing_node",
    "flatten_with_paths",
    "describe",
    "short_repr",
]

NAMESPACE = "fdp"
"""The optree namespace fdp flattens in: register custom containers there."""

# The exact types of plain tensor leaves (the all-tensor fast paths of scatter and gather).
TENSOR_TYPES: frozenset[type] = frozenset({torch.Tensor, torch.nn.Parameter})
# The quantized dtypes: no reduction takes them, and tensors of them join into one only at one
# scale (a concatenation takes the first one's, clipping the others' values to its range).
QUANTIZED_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4}
)
# Types that are always leaves, so the per-call node-type check is one set lookup per leaf.
_LEAF_TYPES: set[type] = {
    *TENSOR_TYPES,
    int,
    float,
    bool,
    complex,
    str,
    bytes,
    type(None),
    torch.device,
    torch.dtype,
}
_REGISTERED: set[type] = set()


def always_leaf(cls: type) -> None:
    """Counts ``cls`` (one of fdp's own value types) among the types that are always leaves."""
    _LEAF_TYPES.add(cls)


# Other types found to be leaves. A user may register one with optree later, so this cache is
# emptied whenever the types registered with optree change. Weak: a class made at run time (one
# defined inside a function, or a parametrized module's, which torch.nn.utils.parametrize makes
# for that module alone and whose properties close over it) must not be kept, with all that it
# refers to, for as long as the process runs, nor pile up call after call.
_SEEN_LEAF_TYPES: weakref.WeakSet[type] = weakref.WeakSet()
_seen_generation: tuple[int, Any] | None = None
# Dataclasses that cannot be rebuilt from their fields (no generated __init__, InitVars): they
# stay leaves, and splitting one that holds tensors is an error (see unsplittable_reason).
# Weak, as the leaf types above are.
OPAQUE_DATACLASSES: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def _fresh_registry_lock_after_fork() -> None:
    # Fork copies only the forking thread: a lock another thread held then stays held in the
    # child for good, and its first new dataclass would wait for it forever.
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_registry_lock_after_fork)


# How many distinct dataclasses of each (module, qualified name) fdp registered: many of one
# name are a class defined inside a function that runs every step (see _count_redefinition).
_REGISTERED_NAMES: collections.Counter[tuple[str, str]] = collections.Counter()
REDEFINITIONS_WARNED_AT = 100


def _count_redefinition(cls: type) -> None:
    """Warns once a name has been registered for :data:`REDEFINITIONS_WARNED_AT` distinct classes.

    optree's registry holds its types for good, so each class that a ``@dataclass`` statement
    inside a function makes at every call stays registered, with every object it references:
    memory grows call after call, and each new type empties fdp's caches of types and
    structures. Nothing can unregister the old ones safely (an instance may still be held), so
    this tells the user instead.
    """
    name = (cls.__module__, cls.__qualname__)
    _REGISTERED_NAMES[name] += 1
    if _REGISTERED_NAMES[name] == REDEFINITIONS_WARNED_AT:
        warnings.warn(
            f"fdp has registered {REDEFINITIONS_WARNED_AT} distinct dataclasses named "
            f"{cls.__qualname__!r} (module {cls.__module__!r}) with optree to flatten them: a "
            "@dataclass defined inside a function is a new class at every call, and each one "
            "stays registered for good (optree's registry keeps its types), so memory grows "
            "with every call and fdp's caches start over. Define the dataclass once, at module "
            "level.",
            RuntimeWarning,
            stacklevel=stacklevel_outside_fdp(),
        )


_PACKAGE_DIRECTORY = os.path.dirname(os.path.abspath(__file__)) + os.sep


def stacklevel_outside_fdp() -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller name the first
    frame outside fdp: the user's line that led to it, not fdp's own. (Python 3.12's
    ``skip_file_prefixes`` does this; fdp supports 3.11.) 2, the caller's caller, when every
    frame is fdp's (a worker thread)."""
    frame: types.FrameType | None = sys._getframe(1)  # the caller, whose warnings.warn counts it as level 1
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIRECTORY):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def _register_dataclass(cls: type) -> None:
    """Registers a dataclass in the fdp namespace: init fields are children, rebuilt with cls(**fields).

    A dataclass that cannot be rebuilt that way goes to :data:`OPAQUE_DATACLASSES` instead.

    This follows ``optree.dataclasses.register_node`` (fields whose ``metadata['pytree_node']``
    is False are metadata) without marking the user's class, so the user stays free to register
    it in their own namespace later.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if params is not None and not params.init:
        OPAQUE_DATACLASSES[cls] = "it has no generated __init__ to rebuild it with"
        return
    initvars = [
        f.name
        for f in cls.__dataclass_fields__.values()  # type: ignore[attr-defined]
        if f._field_type is dataclasses._FIELD_INITVAR  # type: ignore[attr-defined]
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if initvars:
        OPAQUE_DATACLASSES[cls] = f"its InitVar field(s) {initvars} are not stored on the instance"
        return
    fields = [f for f in dataclasses.fields(cls) if f.init]
    children = tuple(f.name for f in fields if f.metadata.get("pytree_node", True))
    metadata = tuple(f.name for f in fields if not f.metadata.get("pytree_node", True))
    # Fields that cls(**fields) sets itself, to their defaults or in __post_init__, and those of
    # them it was seen to set to a tensor (a class's __post_init__ does what it does for every
    # instance: one look per field is enough).
    late = tuple(f.name for f in dataclasses.fields(cls) if not f.init)
    recomputed: set[str] = set()

    def flatten_fields(obj: Any) -> tuple[tuple[Any, ...], tuple[tuple[str, Any], ...], tuple[str, ...]]:
        values = tuple(getattr(obj, name) for name in children)
        meta = tuple((name, getattr(obj, name)) for name in metadata)
        if late:
            check_late_fields(obj, values, meta)
        return values, meta, children

    def check_late_fields(obj: Any, values: tuple[Any, ...], meta: tuple[tuple[str, Any], ...]) -> None:
        """Refuses an instance with a tensor in a late field that the rebuild would not set
        again (one set after construction, say): each replica would silently get the field's
        default instead. Checked when flattening, not in the structure, which a prefix of axes
        (``in_axes=Batch(x=0)``, whose late fields hold no tensor) must match."""
        unknown = [
            name for name in late if name not in recomputed and _holds_tensor(getattr(obj, name, None))
        ]
        if not unknown:
            return
        probe = rebuild(meta, values)
        for name in unknown:
            value = getattr(probe, name, None)
            if not _holds_tensor(value):
                held = getattr(obj, name)
                what = (
                    "a tensor" if isinstance(held, torch.Tensor) else f"tensors (in a {type(held).__name__})"
                )
                raise RebuildError(
                    obj,
                    f"fdp cannot rebuild the dataclass {cls.__qualname__}: its field {name!r} "
                    f"(init=False) holds {what}, but {cls.__qualname__}(**init fields), which "
                    f"fdp calls to rebuild it from its split fields, sets it to {short_repr(value)}. "
                    f"Compute {name!r} in __post_init__ from the init fields, make it an init "
                    f"field, or register {cls.__qualname__} with optree.register_pytree_node(..., "
                    f"namespace={NAMESPACE!r})",
                )
            recomputed.add(name)

    def rebuild(meta: tuple[tuple[str, Any], ...], values: tuple[Any, ...]) -> Any:
        kwargs = dict(zip(children, values))
        kwargs.update(meta)
        return cls(**kwargs)

    optree.register_pytree_node(
        cls,  # type: ignore[arg-type]
        flatten_fields,  # type: ignore[arg-type]
        rebuild,  # type: ignore[arg-type]
        path_entry_type=optree.DataclassEntry,
        namespace=NAMESPACE,
    )
    _count_redefinition(cls)


class UnplacedError(Exception):
    """An object that fdp cannot flatten, found while flattening, where neither the call nor
    the key path is known: callers that know them say them with :meth:`at`."""

    kind: type[Exception] = ValueError  # the type raised by at()

    def __init__(self, obj: Any, message: str) -> None:
        super().__init__(message)
        self.obj = obj

    def at(
        self,
        caller: str,
        parts: Sequence[Any],
        roots: Sequence[str],
        rename: Callable[[str], str] | None = None,
    ) -> Exception:
        """This error as ``caller``'s, at the key path of the instance in the trees ``parts``
        (named ``roots``; ``rename`` rewrites the path, as fdp.DataParallel's calls do), e.g.
        ``fdp.pmap(f): args[0]['batch']: fdp cannot rebuild ...``."""
        obj, test = self.obj, is_leaf()
        # Leaves here: flattened, this instance would raise again, and so would any other
        # instance with the same fault (optree flattens the whole tree, past this one).
        unflattened = {id(obj)}

        def stop(node: Any) -> bool:
            return id(node) in unflattened or (test is not None and test(node))

        for part, root in zip(parts, roots):
            while True:
                try:
                    accessors, leaves, _ = optree.tree_flatten_with_accessor(
                        part, is_leaf=stop, namespace=NAMESPACE
                    )
                    break
                except UnplacedError as other:
                    if id(other.obj) in unflattened:  # not from flattening it: give up the path
                        return self.kind(f"{caller}: {self.args[0]}")
                    unflattened.add(id(other.obj))
            for accessor, leaf in zip(accessors, leaves):
                if leaf is obj:
                    path = accessor.codify(root)
                    return self.kind(f"{caller}: {path if rename is None else rename(path)}: {self.args[0]}")
        return self.kind(f"{caller}: {self.args[0]}")


class RebuildError(UnplacedError, ValueError):
    """A dataclass instance that fdp would rebuild wrongly (see ``check_late_fields``)."""


class AmbiguousNodeError(UnplacedError, TypeError):
    """An instance of a class registered in several optree namespaces other than fdp's."""

    kind = TypeError


def _holds_tensor(value: Any) -> bool:
    """Whether ``value`` (a dataclass's late field) is a tensor or holds one: in a container
    that fdp flattens (a dict or list of tensors, set after construction as a tensor may be), or
    as a field of a dataclass among its leaves. Dataclasses are looked into one level down, not
    flattened: one registered would check its own late fields, and two that refer to each other
    there would recurse for good."""
    if isinstance(value, torch.Tensor):
        return True
    if type(value) in _LEAF_TYPES:  # numbers, strings, None: one set lookup
        return False
    for leaf in optree.tree_leaves(value, is_leaf=_is_dataclass_instance, namespace=NAMESPACE):
        if isinstance(leaf, torch.Tensor) or (
            _is_dataclass_instance(leaf)
            and any(isinstance(getattr(leaf, f.name, None), torch.Tensor) for f in dataclasses.fields(leaf))
        ):
            return True
    return False


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _namespaces_registering(cls: type) -> list[str]:
    """The optree namespaces (other than fdp's) in which ``cls`` is registered as a node.

    optree has no public listing of namespaces, so their names are read off its registry's keys
    (:func:`_registrations`); the entries themselves come from the public
    ``register_pytree_node.get``. If optree's internals change, this finds nothing and such
    types stay leaves.
    """
    return sorted({namespace for namespace, node in _registrations() if node is cls} - {"", NAMESPACE})


def _adopt_registration(cls: type, namespaces: list[str], leaf: Any) -> None:
    """Registers in fdp's namespace the node type a user registered in their own (``leaf`` an
    instance, for the error's key path)."""
    if len(namespaces) > 1:
        raise AmbiguousNodeError(
            leaf,
            f"{cls.__qualname__} is registered with optree in several namespaces {namespaces}, so "
            f"fdp cannot tell how to split it. Register it in fdp's namespace too: "
            f"optree.register_pytree_node({cls.__name__}, ..., namespace={NAMESPACE!r}).",
        )
    entry = optree.register_pytree_node.get(cls, namespace=namespaces[0])
    assert isinstance(entry, optree.registry.PyTreeNodeRegistryEntry)
    optree.register_pytree_node(
        cls,  # type: ignore[arg-type]
        entry.flatten_func,
        entry.unflatten_func,
        path_entry_type=entry.path_entry_type,
        namespace=NAMESPACE,
    )


# optree's registry of node types (one dict, changed in place): read for the namespaces that
# register a type, and to tell when it changed. Not public: where it is missing, fdp adopts no
# registration from other namespaces and leaves the telling of tensors apart to optree.
_NODE_TYPES = getattr(optree.registry, "_NODETYPE_REGISTRY", None)


def _registrations() -> list[tuple[str, Any]]:
    """``(namespace, type)`` for every node type registered with optree; ``""`` is the global
    namespace (optree's built-in types, keyed by the type alone)."""
    if not isinstance(_NODE_TYPES, dict):
        return []
    return [key if isinstance(key, tuple) and len(key) == 2 else ("", key) for key in list(_NODE_TYPES)]


def _registry_generation() -> tuple[int, Any] | None:
    """A summary of optree's registry that changes when it does: its size and its last key.

    A registration appends its key (the type, with its namespace) to the dict, so after any
    registration the last key is one that was not there before; an unregistration alone
    shrinks it. The size alone would miss one type unregistered and another registered in
    between. (What this misses: the last type unregistered, other types swapped, and the last
    type registered again, in between two calls.) Both are read in constant time: the whole
    key list would cost more per call with every type registered (fdp registers every
    dataclass it meets).
    """
    if not isinstance(_NODE_TYPES, dict):
        return None
    return len(_NODE_TYPES), next(reversed(_NODE_TYPES), None)


# isinstance(x, torch.Tensor), as a function implemented in C, for optree's ``is_leaf``: optree
# classifies an object it has no registration for (a tensor) by looking its type up in the
# namespace's and the global registrations, then testing for namedtuples and structseqs,
# which costs ~0.3 us per leaf; this test answers first, and flattens a tree of tensors about
# twice as fast.
_IS_TENSOR = torch.Tensor.__instancecheck__
# (registry generation, the is_leaf to flatten with), recomputed when the registry changes.
_leaf_test: tuple[tuple[int, Any] | None, Any] = (None, None)


def is_leaf() -> Any:
    """The ``is_leaf`` every flatten in the fdp namespace uses: tensors are leaves, as optree
    makes them anyway, unless a tensor type is registered as a node in fdp's or the global
    namespace (then None, optree's own classification, which honours that registration).
    Under ``torch.compile`` it is None too: dynamo traces optree's Python stand-in, and cannot
    trace a C function given as ``is_leaf``."""
    global _leaf_test
    if torch.compiler.is_compiling():
        return None
    generation = _registry_generation()
    cached = _leaf_test
    if generation is not None and cached[0] == generation:
        return cached[1]
    test = _IS_TENSOR if generation is not None and not _tensor_nodes_registered() else None
    _leaf_test = (generation, test)
    return test


def _tensor_nodes_registered() -> bool:
    """Whether some tensor type is registered with optree as a node where fdp flattens."""
    return any(
        namespace in ("", NAMESPACE) and isinstance(node, type) and issubclass(node, torch.Tensor)
        for namespace, node in _registrations()
    )


def _register_new_node_types(leaves: Sequence[Any]) -> bool:
    """Makes node types of the leaves that should be containers; True if the tree must be
    flattened again (a type was new, or registered by another thread meanwhile).

    A leaf whose type a user registered with optree in another namespace gets that
    registration in fdp's; a plain dataclass gets :func:`_register_dataclass`'s.
    """
    global _seen_generation
    generation = _registry_generation()
    if generation is None or generation != _seen_generation:
        _SEEN_LEAF_TYPES.clear()
        _seen_generation = generation
    new = False
    for leaf in leaves:
        cls = type(leaf)
        if cls in _LEAF_TYPES or cls in _SEEN_LEAF_TYPES:
            continue
        if cls in _REGISTERED:
            # A node type, yet a leaf here: registered by another thread after this tree was
            # flattened (then flatten again), or unregistered by the user since (a leaf now).
            if optree.register_pytree_node.get(cls, namespace=NAMESPACE) is not None:
                new = True
            continue
        with _REGISTRY_LOCK:
            if cls in _REGISTERED:  # by another thread, while this one waited for the lock
                new = True
                continue
            if cls in _SEEN_LEAF_TYPES:
                continue
            if isinstance(leaf, type):
                _SEEN_LEAF_TYPES.add(cls)  # a class object (e.g. a dataclass type) is a value
                continue
            namespaces = _namespaces_registering(cls)
            if namespaces:
                _adopt_registration(cls, namespaces, leaf)
            elif (
                dataclasses.is_dataclass(cls)
                and cls not in OPAQUE_DATACLASSES
                # A module written as a dataclass is an object with state, like any module:
                # rebuilt from its fields it would be a new module (new weights, too).
                and not issubclass(cls, torch.nn.Module)
            ):
                _register_dataclass(cls)
                if cls in OPAQUE_DATACLASSES:
                    _SEEN_LEAF_TYPES.add(cls)
                    continue
            else:
                _SEEN_LEAF_TYPES.add(cls)
                continue
            _REGISTERED.add(cls)
        new = True
    return new


def unsplittable_reason(leaf: Any, caller: str = "fdp.pmap") -> str | None:
    """Why ``leaf``, a leaf other than a tensor under an int axis, cannot be split: an array of
    another library (a NumPy array, say), or a dataclass fdp cannot rebuild that holds a tensor.
    None for a leaf that every replica may get whole (a number, a string, any other object)."""
    cls = type(leaf)
    if cls in _LEAF_TYPES or cls is torch.Size:  # numbers, strings, None: one set lookup
        return None
    reason = OPAQUE_DATACLASSES.get(cls)
    if reason is None:
        shape = getattr(leaf, "shape", None) if hasattr(leaf, "__array__") else None
        if isinstance(shape, tuple) and shape:
            # Passed whole, each replica would get every row: a JAX habit (jax.pmap splits
            # NumPy arrays) that gives wrong shapes, or a silent broadcast, rather than an error.
            kind = f"{cls.__module__.partition('.')[0]}.{cls.__qualname__}"
            return (
                f"a {kind} of shape {shape} is not a torch.Tensor, and fdp splits only tensors: "
                "every replica would get all of it. Convert it with torch.as_tensor to split it; "
                f"to give every replica all of it, {whole_advice(caller, old_note=True)}"
            )
        # (UserDict and UserList looked for in the MRO by _unflattened_container: isinstance
        # goes through the ABC machinery for them, ~0.4 µs each for every object passed.)
        return _unflattened_container_reason(leaf, caller)
    if not any(isinstance(getattr(leaf, f.name, None), torch.Tensor) for f in dataclasses.fields(leaf)):
        return None
    return (
        f"fdp cannot split the dataclass {type(leaf).__qualname__}: {reason}. Register it with "
        f"optree.register_pytree_node(..., namespace={NAMESPACE!r}) to say how to flatten and "
        "rebuild it, or give it axis None to pass it whole"
    )


def whole_advice(caller: str, *, old_note: bool = False) -> str:
    """How to give every replica all of an argument that ``caller`` would split; with
    ``old_note``, that ``nn.DataParallel`` did so."""
    if caller.startswith("fdp.DataParallel"):  # no in_axes: every argument is mapped
        old = "; nn.DataParallel gave such an array whole to every replica" if old_note else ""
        return f"hold it on the module instead of passing it (fdp.DataParallel maps every argument{old})"
    if caller.startswith("fdp.scatter"):
        return "give it axis None in in_axes"
    if caller.startswith("fdp.distributed"):  # shard_batch: every process gets what is not split
        return "leave it out of the batch that shard_batch splits"
    return "pass it positionally with axis None in in_axes (keyword arguments are always split)"


def _unflattened_container(leaf: Any) -> type | None:
    """The plain type (dict, list or tuple) of a leaf that is a container optree does not
    flatten (a subclass of dict, list or tuple, a ``collections.UserDict`` or ``UserList``) and
    holds tensors; None for any other leaf.

    optree flattens the container types registered with it, and no subclass of them (but
    namedtuples): such a container is one leaf, whose tensors fdp neither splits nor joins.
    ``nn.DataParallel`` split dict subclasses; a Hugging Face ``BatchEncoding`` is a
    ``UserDict``. (Its contents are looked at one level deep, as optree flattens them: a tensor
    inside another such container in it is not seen. Not every Mapping: a config object, such
    as omegaconf's DictConfig or os.environ, would be read, and its values resolved, on every
    call.)
    """
    mro = type(leaf).__mro__
    if not (
        isinstance(leaf, (dict, list, tuple)) or collections.UserDict in mro or collections.UserList in mro
    ):
        return None
    plain: type = (
        dict if isinstance(leaf, (dict, collections.UserDict)) else tuple if isinstance(leaf, tuple) else list
    )
    try:
        contents: Any = plain(leaf)
    except Exception:  # noqa: BLE001 - not a container fdp can read: a leaf like any other
        return None
    if not any(isinstance(x, torch.Tensor) for x in optree.tree_leaves(contents, namespace=NAMESPACE)):
        return None
    return plain


# Why optree leaves such a container whole, for the messages about one.
_NOT_FLATTENED = (
    "a container of a type that fdp does not flatten (optree flattens the container types "
    "registered with it, not their subclasses nor UserDict and UserList)"
)


def _unflattened_container_reason(leaf: Any, caller: str) -> str | None:
    """Why a leaf that is a container optree does not flatten, if it holds tensors, cannot be
    split: every replica would get it whole, each with all the rows (n times the rows in the
    output, silently)."""
    plain = _unflattened_container(leaf)
    if plain is None:
        return None
    name = type(leaf).__qualname__
    return (
        f"a {name} holding tensors, {_NOT_FLATTENED}, so every replica would get all of it. Pass a "
        f"plain {plain.__name__} ({plain.__name__}(obj)) to split it, or register {name} with "
        f"optree.register_pytree_node(..., namespace={NAMESPACE!r}); to give every replica all of "
        f"it, {whole_advice(caller)}"
    )


# Values that hold a function's work not done yet, by exact type: (what it is, when it runs).
_DEFERRED: dict[type, tuple[str, str]] = {
    types.GeneratorType: ("a generator", "iterated"),
    types.CoroutineType: ("a coroutine", "awaited"),
    types.AsyncGeneratorType: ("an asynchronous generator", "iterated with async for"),
    map: ("a map object, a lazy iterator", "iterated"),
    filter: ("a filter object, a lazy iterator", "iterated"),
}
DEFERRED_TYPES: frozenset[type] = frozenset(_DEFERRED)

# Advice for async code, in the refusals of a coroutine function and of a coroutine returned.
NOT_ON_AN_EVENT_LOOP = (
    "fdp runs the replicas in threads, not on an event loop (from async code, call the pmapped "
    "function in a thread: await asyncio.to_thread(pmapped, ...))"
)


def deferred_reason(value: Any) -> str | None:
    """Why a replica may not return ``value``, where it is a generator, a coroutine or a lazy
    ``map``/``filter``: the work it stands for would run after the call, as the caller iterates
    or awaits it, in the caller's thread, outside the replica (no replica index, axis or device
    of its own); on several replicas, fdp would compare them as values, which they never are.
    Words that follow "the mapped function" or "the replicas"."""
    found = _DEFERRED.get(type(value))
    if found is None:
        return None
    what, when = found
    if isinstance(value, (types.CoroutineType, types.AsyncGeneratorType)):
        advice = f"Map a plain function (def), not an async one: {NOT_ON_AN_EVENT_LOOP}"
    else:
        advice = "Return the values themselves: a tensor, or a list or tuple of them (list(...) of it)"
    return (
        f"returned {what}, whose work runs only when it is {when}: after the call, in the "
        "caller's thread, outside the replica (with no replica index, axis or device of its "
        f"own). {advice}"
    )


def unjoinable_reason(leaf: Any, caller: str = "") -> str | None:
    """Why replicas' outputs like ``leaf`` (one replica's) cannot be joined, when it is work
    not done yet (see :func:`deferred_reason`) or a container optree does not flatten that holds
    tensors: fdp would compare the replicas'
    containers as values (a tensor's == has no truth value, so they never agree, and the
    error would speak of "different non-tensor values"), or, where == happened to hold,
    return one replica's tensors for the whole batch. (Reached for every non-tensor output
    leaf that the replicas return as distinct objects, equal floats among them: numbers and
    strings leave at once.)"""
    if type(leaf) in _LEAF_TYPES:
        return None
    if (deferred := deferred_reason(leaf)) is not None:
        return f"the replicas {deferred}"
    plain = _unflattened_container(leaf)
    if plain is None:
        return _object_with_tensors_reason(leaf, caller)
    name = type(leaf).__qualname__
    return (
        f"the replicas returned a {name} holding tensors, {_NOT_FLATTENED}, so fdp cannot join the "
        f"tensors in it. Return a plain {plain.__name__} ({plain.__name__}(obj)), or register {name} "
        f"with optree.register_pytree_node(..., namespace={NAMESPACE!r})"
    )


def _object_with_tensors_reason(leaf: Any, caller: str) -> str | None:
    """Why replicas' outputs like ``leaf``, an object (not a container) with tensors among its
    attributes, cannot be joined: a policy's ``torch.distributions.Categorical``, say. Compared
    as values they never agree (objects compare by identity), and the error spoke of "different
    non-tensor values", printing two identical reprs; where a custom ``==`` held, one replica's
    tensors would stand for the whole batch. Only the object's own attributes are looked at."""
    names = tensor_attributes(leaf)
    if not names:
        return None
    public = [k for k in names if not k.startswith("_")] or names  # Categorical's _param: logits
    name = type(leaf).__qualname__
    keep = ", keep each replica's with out_axes=fdp.PER_REPLICA" if caller.startswith("fdp.pmap") else ""
    return (
        f"the replicas returned a {name} holding tensors (its attributes {', '.join(public)}), an "
        f"object that fdp does not flatten, so fdp cannot join the tensors in it. Return the "
        f"tensors (e.g. {public[0]}) and build the {name} from them after the call{keep}, or "
        f"register {name} with optree.register_pytree_node(..., namespace={NAMESPACE!r})"
    )


def tensor_attributes(obj: Any) -> list[str]:
    """The names of ``obj``'s own attributes that hold tensors (none for an object without a
    ``__dict__``, slots or builtins: nothing fdp can name), for messages about an object that
    fdp does not flatten."""
    attributes = getattr(obj, "__dict__", None)
    if not isinstance(attributes, dict):
        return []
    return [k for k, v in attributes.items() if isinstance(v, torch.Tensor)]


# Containers that optree always flattens. One found as a leaf means that optree's registry is
# gone: optree empties it at exit, in the atexit hook it registers when imported (with fdp,
# unless imported before), so a hook registered before `import fdp` runs after it. Every tree
# would then be one leaf, and calls would fail with errors about arguments that are fine.
_BUILTIN_NODES = frozenset({tuple, list, dict})
_REGISTRY_GONE = (
    "fdp was called after optree cleared its registry of container types at interpreter exit "
    "(tuples, lists and dicts would be single leaves): from an atexit hook registered before "
    "fdp (and optree) were imported, which runs after optree's own. Register the hook after "
    "`import fdp`, or import optree before registering it."
)


def flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flattens ``tree`` in the fdp namespace, registering plain dataclasses on first sight."""
    leaves, spec = optree.tree_flatten(tree, is_leaf=is_leaf(), namespace=NAMESPACE)
    if _LEAF_TYPES.issuperset(map(type, leaves)):
        return leaves, spec  # the usual case: tensors and plain values, nothing to register
    if not _BUILTIN_NODES.isdisjoint(map(type, leaves)):
        raise RuntimeError(_REGISTRY_GONE)
    # A newly registered dataclass may hold further dataclasses: flatten until none is left.
    while _register_new_node_types(leaves):
        leaves, spec = optree.tree_flatten(tree, is_leaf=is_leaf(), namespace=NAMESPACE)
    return leaves, spec


def flatten_for(tree: Any, caller: str, root: str) -> tuple[list[Any], optree.PyTreeSpec]:
    """:func:`flatten` for ``caller``, whose argument ``tree`` is named ``root`` in messages: an
    object that cannot be flattened (see :class:`UnplacedError`) is said as ``caller``'s, at its
    key path (``fdp.psum: x['b']: ...``)."""
    try:
        return flatten(tree)
    except UnplacedError as err:
        raise err.at(caller, (tree,), (root,)) from None


def flatten_like(
    tree: Any, spec: optree.PyTreeSpec, types: list[type]
) -> tuple[list[Any], optree.PyTreeSpec]:
    """:func:`flatten` for a ``tree`` expected to have the structure ``spec`` with leaves of
    ``types`` (another replica's output): then ``spec.flatten_up_to``, at a tenth of the cost.
    Anything else gets the full :func:`flatten`, so callers see the true structure.

    Dict-like containers are matched by their keys, as ``flatten_up_to`` does: a replica whose
    dict has another key order, or is an ``OrderedDict`` where the first replica's is a
    ``dict``, counts as having the first one's structure, whose containers the result keeps.
    """
    leaves = _along(tree, spec, types)
    return (leaves, spec) if leaves is not None else flatten(tree)


class LastStructure:
    """:func:`flatten` for a stream of trees that mostly repeat one structure (a pmapped
    function's arguments, call after call): a tree with the previous one's structure and leaf
    types is flattened along it with ``flatten_up_to``, at a tenth of the cost.

    Only structures without dict-like containers or deques take that path: ``flatten_up_to``
    matches those by their keys alone, not by their type, key order, ``default_factory`` or
    ``maxlen`` (by design, so that ``tree_map`` can mix a ``dict`` with an ``OrderedDict``:
    metaopt/optree#27), and a structure kept from an earlier call would rebuild the caller's
    trees with that call's containers. Nor do structures whose nodes hold data (a dataclass's
    non-node fields), which it matches by ``==`` (see :func:`_flattens_along`). Trees with
    either are flattened in full every time.

    With ``exact=False`` a tree that repeats the last structure up to those containers' types
    and key orders is flattened along it too, for callers that rebuild nothing from the
    structure returned (a lone replica gets its arguments as they were passed, and returns its
    output as it is where it can): its leaves come in the order of the last structure's.

    The caller can :meth:`keep` one value with the structure (what it worked out for it, e.g. a
    plan): :meth:`flatten` hands it back while trees repeat the structure, with no hash of the
    structure to look it up by.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        # (structure, leaf types, optree registry generation, kept value, flattened along?):
        # one attribute, replaced whole, so concurrent calls never see a mix of two calls'.
        self._last: tuple[optree.PyTreeSpec, list[type], tuple[int, Any] | None, Any, bool] | None = None

    def flatten(self, tree: Any, *, exact: bool = True) -> tuple[list[Any], optree.PyTreeSpec, Any, bool]:
        """``tree``'s leaves and structure, the value kept with it (None if none), and whether
        that structure is surely the tree's own (not one matched loosely with ``exact=False``)."""
        last = self._last
        generation = _registry_generation()  # no type changed kind since: same structures
        if last is not None and (last[4] or not exact) and last[2] == generation:
            spec, types, _, kept, along = last
            leaves = _along(tree, spec, types)
            if leaves is not None:
                return leaves, spec, kept, along
        leaves, spec = flatten(tree)
        types = list(map(type, leaves))
        if last is not None and last[2] == generation and last[1] == types and same_structure(last[0], spec):
            # The same structure up to dict key orders (which spec equality ignores): the same
            # leaf order, so the kept value still holds, and the same kinds of containers.
            along, kept = last[4], last[3]
        else:
            along, kept = _flattens_along(spec), None
            if not along and _holds_tensors(spec):
                # A tensor in a node's data (a dataclass's non-node field): kept with the
                # structure, it would stay alive, with its memory, for as long as the caller
                # lives (a pmapped function, after its last call); nor is such a structure
                # cached elsewhere (see SpecCache).
                self._last = None
                return leaves, spec, None, True
        self._last = (spec, types, generation, kept, along)
        return leaves, spec, kept, True

    def kept(self) -> Any:
        """The value kept with the last structure flattened (None if none)."""
        last = self._last
        return None if last is None else last[3]

    def keep(self, spec: optree.PyTreeSpec, value: Any) -> None:
        """Keeps ``value`` with ``spec`` if that is still the last structure flattened."""
        last = self._last
        if last is not None and last[0] is spec:
            self._last = (spec, last[1], last[2], value, last[4])


_V = TypeVar("_V")

# What comparing structures raises where their node data cannot be compared with == (e.g. a
# tensor in a dataclass's non-node field, whose == is elementwise and has no truth value).
_UNCOMPARABLE = (ValueError, TypeError, RuntimeError)


class SpecCache(dict[optree.PyTreeSpec, _V]):
    """A dict keyed by tree structures (plans and layouts, per input or output structure).

    A structure holding node data that cannot be compared with ``==`` (a tensor in a
    dataclass's non-node field) is never found nor kept: comparing it with another structure of
    equal hash would raise, and a tensor hashes by identity, so each call's would be kept (and
    kept alive) anew. At most :attr:`MAX_ENTRIES` structures are kept, the oldest dropped first:
    a program whose structures never repeat (a dict keyed by sample ids, a step number in a
    dataclass's non-node field) would otherwise add one per call, for as long as it runs.
    """

    MAX_ENTRIES = 256  # far more than the structures of a program's calls (train, eval, the last batch)

    def get(self, spec: optree.PyTreeSpec, default: Any = None) -> Any:  # type: ignore[override]
        try:
            return super().get(spec, default)
        except _UNCOMPARABLE:
            return default

    def __setitem__(self, spec: optree.PyTreeSpec, value: _V) -> None:
        # (A new structure: the walk below costs far less than the plan made for it.)
        if _holds_tensors(spec):
            return
        with contextlib.suppress(*_UNCOMPARABLE):
            if len(self) >= self.MAX_ENTRIES:
                self.pop(next(iter(self)), None)
            super().__setitem__(spec, value)


def _holds_tensors(spec: optree.PyTreeSpec) -> bool:
    """Whether a node of ``spec`` holds a tensor in its data (a dataclass's non-node field);
    True where its data cannot be looked into (a user's node type that fails to flatten): such
    a structure is not kept either."""
    try:
        return any(
            isinstance(leaf, torch.Tensor)
            for node_type, data in _nodes(spec)
            # (A dict's data is its keys, a deque's its maxlen: looked past, they are most of it.)
            if data is not None
            and not isinstance(data, type)
            and not issubclass(node_type, _KEYED_CONTAINERS)
            for leaf in optree.tree_leaves(data, none_is_leaf=True)
        )
    except Exception:  # noqa: BLE001 - whatever a user's flatten function raises
        return True


def same_structure(a: optree.PyTreeSpec, b: optree.PyTreeSpec) -> bool:
    """``a == b``, False where node data cannot be compared with ``==`` (a tensor in a
    dataclass's non-node field): such structures are never known to be the same."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except _UNCOMPARABLE:
        return False


def replicas_agree(a: optree.PyTreeSpec, b: optree.PyTreeSpec) -> bool:
    """:func:`same_structure` for the trees of two replicas (outputs, a collective's values):
    NaN in node data counts as equal to NaN, as replicas' NaN leaves do.

    Each replica that computes ``float("nan")`` (a dataclass's non-node ``scale``, say) makes
    an object of its own, equal to no other nor to itself, so ``==`` alone would call the
    same tree of two structures. Looked at only where ``==`` says they differ: no cost for
    structures that agree."""
    if same_structure(a, b):
        return True
    if a.num_nodes != b.num_nodes or a.num_leaves != b.num_leaves or a.namespace != b.namespace:
        return False
    try:
        return bool(_without_nan(a) == _without_nan(b))
    except _UNCOMPARABLE:
        return False


class _NaN:
    """Stands for a float or complex NaN in :func:`_without_nan`: equal to itself."""

    __slots__ = ()


_NAN = _NaN()


def _without_nan(spec: optree.PyTreeSpec) -> Any:
    """``spec`` as nested tuples of (node type, node data, children), with every NaN in the
    node data replaced by one object (dict keys come sorted, as ``==`` on structures takes them)."""

    def node(node_type: type, node_data: Any, children: tuple[Any, ...]) -> Any:
        data = optree.tree_map(
            lambda x: _NAN if isinstance(x, float | complex) and x != x else x, node_data, none_is_leaf=True
        )
        return node_type, data, children

    return spec.walk(range(spec.num_leaves), f_node=node)


# Containers that flatten_up_to matches by their keys alone (see LastStructure).
_KEYED_CONTAINERS = (dict, collections.deque)


def has_keyed_containers(tree: Any) -> bool:
    """Whether ``tree`` has dict-like containers or deques (see :class:`LastStructure`)."""
    spec = optree.tree_structure(tree, is_leaf=is_leaf(), namespace=NAMESPACE)
    return any(issubclass(t, _KEYED_CONTAINERS) for t, _ in _nodes(spec))


def _nodes(spec: optree.PyTreeSpec) -> list[tuple[type, Any]]:
    """Every node of ``spec``: its type and its node data."""
    nodes: list[tuple[type, Any]] = []
    spec.walk(
        range(spec.num_leaves), f_node=lambda node_type, data, children: nodes.append((node_type, data))
    )
    return nodes


def _flattens_along(spec: optree.PyTreeSpec) -> bool:
    """Whether ``flatten_up_to`` along ``spec`` accepts only trees of exactly this structure.

    Not where a node holds data (a dataclass's non-node fields, a custom node's metadata) other
    than a class (a namedtuple's): ``flatten_up_to`` compares it with ``==``, which holds for
    values that are not the same (``2 == 2.0``, ``1 == True``, equal 0-dim tensors), and the
    tree rebuilt from the kept structure would get the earlier call's value, silently (a
    float ``scale`` that scales an int tensor as an int).
    """
    return not any(
        issubclass(t, _KEYED_CONTAINERS)
        or not (data is None or isinstance(data, type) or (type(data) is tuple and not data))
        for t, data in _nodes(spec)
    )


def _along(tree: Any, spec: optree.PyTreeSpec, types: list[type]) -> list[Any] | None:
    """``tree``'s leaves if it has the structure ``spec`` and leaves of ``types``; else None.

    ``spec.flatten_up_to`` follows a known structure instead of discovering it and sorting dict
    keys anew. It hands back whole subtrees where ``spec`` has leaves: a leaf type at every
    position says there are none.
    """
    try:
        leaves = spec.flatten_up_to(tree)
    except _UNCOMPARABLE:
        # A different node somewhere, or node data that cannot be compared with == (a tensor
        # in a dataclass's non-node field): then not known to be the same structure.
        return None
    return leaves if list(map(type, leaves)) == types else None


def unflatten(spec: optree.PyTreeSpec, leaves: Sequence[Any]) -> Any:
    return optree.tree_unflatten(spec, leaves)


def refusing_node(
    spec: optree.PyTreeSpec, leaves: Sequence[Any], marked: Sequence[bool], root: str
) -> tuple[str, type, Exception] | None:
    """Where ``spec.unflatten(leaves)`` fails because of the ``marked`` leaves: the key path
    (under ``root``) and type of the deepest node above a marked leaf that raises when rebuilt
    from children that rebuild, with what it raised. None when no such node raises.

    Leaves that a node type was never meant to hold (``fdp.PerReplica`` values where a
    dataclass's ``__post_init__`` reads its field's ``.shape``, or where ``PackedSequence``
    checks its fields' devices) fail inside the user's class, with an error that names neither
    the call nor the output. Rebuilds nodes again, so only for an error's message."""
    accessors: list[Any] | None = None

    def find(node: optree.PyTreeSpec, start: int, depth: int) -> tuple[str, type, Exception] | None:
        nonlocal accessors
        count = node.num_leaves
        if node.is_leaf() or not any(marked[start : start + count]):
            return None
        offset = start
        for child in node.children():
            found = find(child, offset, depth + 1)
            if found is not None:
                return found
            offset += child.num_leaves
        try:
            node.unflatten(leaves[start : start + count])
        except Exception as error:  # noqa: BLE001 - whatever the node's type raises
            if accessors is None:
                accessors = spec.accessors()
            node_type = node.type
            assert node_type is not None  # (None for a leaf alone, left out above)
            return str(accessors[start][:depth].codify(root)), node_type, error
        return None

    return find(spec, 0, 0)


def flatten_with_paths(
    tree: Any, root: str, *, caller: str | None = None
) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """Like :func:`flatten`, with each leaf's key path written as code, e.g. ``args[0]['w']``;
    with ``caller``, as :func:`flatten_for` for it."""
    if caller is None:  # (each registers dataclasses first)
        flatten(tree)
    else:
        flatten_for(tree, caller, root)
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, is_leaf=is_leaf(), namespace=NAMESPACE)
    return [accessor.codify(root) for accessor in accessors], leaves, spec


def packed_sequence_path(
    parts: Sequence[Any], roots: Sequence[str], axes: Sequence[Any], spec: optree.PyTreeSpec
) -> str | None:
    """The key path of the first ``PackedSequence`` in the trees ``parts`` (named ``roots`` in
    messages, flattened together into ``spec``) that holds a leaf with an int axis in ``axes``
    (one per leaf, in flattening order); None if there is none.

    optree flattens a PackedSequence as the namedtuple it is, into tensors of three different
    lengths: its ``data`` holds every sequence's time steps interleaved (``batch_sizes[t]``
    rows for step ``t``), so no split of its fields by rows, nor a concatenation of the
    replicas' fields, is a PackedSequence of some of the sequences. Looked for once per
    structure (the callers cache the answer), and only walked when the structure has one.
    """
    packed = torch.nn.utils.rnn.PackedSequence
    if not any(isinstance(t, type) and issubclass(t, packed) for t, _ in _nodes(spec)):
        return None
    k = 0
    for part, root in zip(parts, roots):
        accessors, _, _ = optree.tree_flatten_with_accessor(part, is_leaf=is_leaf(), namespace=NAMESPACE)
        for accessor in accessors:
            axis = axes[k]
            k += 1
            if type(axis) is not int:  # axis None (whole to every replica) or PER_REPLICA
                continue
            for depth, entry in enumerate(accessor):
                if isinstance(entry.type, type) and issubclass(entry.type, packed):
                    return accessor[:depth].codify(root)
    return None


def describe(value: object) -> str:
    """A short description for error messages: ``float32[8,4]`` for tensors, else the type."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        try:
            shape = value.shape
        except RuntimeError:
            # A nested tensor of torch's strided layout has no shape ("NestedTensorImpl doesn't
            # support sizes"): described by its components, for the message it goes into.
            return f"{dtype}[nested tensor of {value.size(0)} components]"
        return f"{dtype}[{','.join(str(s) for s in shape)}]"
    return type(value).__name__


_F = TypeVar("_F", bound=Callable[..., Any])


def naming_foreign_options(name: str, options: Mapping[str, tuple[str, str]]) -> Callable[[_F], _F]:
    """A decorator for ``name``, a function of fdp's that another library's users call with that
    library's keywords: ``options`` maps each such keyword to whose it is and what to write
    instead (``{value}``, the value passed). Python's "got an unexpected keyword argument"
    says neither.

    The keywords are looked at only once Python refuses the call: none of them is the
    function's, so a call that passes one fails in binding its arguments, before the body could
    raise a TypeError of its own. A call that binds pays one frame (a collective's, on every
    call: a check of the keywords up front cost about twice that).
    """

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except TypeError:
                option = next((key for key in kwargs if key in options), None)
                if option is None:
                    raise
                whose, instead = options[option]
                raise TypeError(
                    f"{name} got an unexpected keyword argument {option!r} ({whose}): "
                    + instead.format(value=kwargs[option])
                ) from None

        return checked  # type: ignore[return-value]

    return decorate


def check_flag(value: object, what: str) -> bool:
    """``value`` as a ``bool`` if it is ``True`` or ``False``, or a NumPy bool (``np.bool_``, as a
    comparison of NumPy values gives: ``maximize=scores.mean() < 0``); else a TypeError naming
    ``what`` (the call and the option) and the value. Read as a truth value, ``"no"`` or
    ``"false"`` would be True, and ``None`` False: ``torch.optim`` takes any value so, and fdp
    refuses them, ``1`` and ``0`` too, which say no more than ``True`` and ``False`` do."""
    if value is True or value is False:
        return value
    numpy = sys.modules.get("numpy")  # (looked up only if the program imported it)
    if numpy is not None and isinstance(value, numpy.bool_):
        return bool(value)
    raise TypeError(f"{what} must be True or False, got {type(value).__name__}: {short_repr(value)}")


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."

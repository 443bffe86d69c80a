"""A thread-safe ``functional_call``: module skeletons that hold no tensor memory.

``torch.func.functional_call`` swaps the given tensors into the module object itself, so two
threads calling it on one module see each other's weights. Here each call gets a *skeleton*: a
copy of every submodule object with its own ``_parameters``, ``_buffers`` and ``_modules`` dicts
(what ``Module._replicate_for_data_parallel`` builds), whose entries still point at the original
tensors. The swap then happens in the skeleton, privately.

Skeletons are cached per module in a small free list (one per concurrent caller, so one per
replica under ``fdp.pmap``) and refreshed from the original on every checkout: changes made to
the module between calls (``model.eval()``, a new attribute, a replaced submodule) are always
seen. Each copy holds the original's hooks in hook dicts of its own (a hook that the call
registers stays with the call, where ``nn.DataParallel``'s replicas put it in the module's, for
every replica to run). Other attribute values are shared with the original, as in
``nn.DataParallel``, but for those that would run or reach a module of the tree itself, the
original, with its own tensors: a bound method of one (``self.act = self._impl``), a
``functools.partial`` or a closure that holds one, a module of the tree held as a plain
attribute, and lists, tuples and dicts of these. Each skeleton copy gets its own, bound to
(or holding) the copies instead (see :func:`_rebound`). Attributes that ``forward`` assigns on
``self`` land on the skeleton and are dropped. A skeleton that something made during the call
still holds (activation checkpointing's graph, which calls ``forward`` again in backward) is
left to it, never reused (see ``_release``).
"""

from __future__ import annotations

import enum
import functools
import operator
import os
import sys
import threading
import types
import weakref
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from . import _replica, _tree

__all__ = ["functional_call", "stateful_call"]

# The names of one tensor registered under several, and each name's module copy and leaf.
_Tie = tuple[frozenset[str], list[tuple[nn.Module, str]]]


class _Skeleton:
    """A structural copy of a module tree; see the module docstring."""

    def __init__(self, root: nn.Module) -> None:
        # Weak references: the cache that holds skeletons is keyed weakly by the module.
        self._pairs: list[tuple[weakref.ref[nn.Module], nn.Module]] = []
        self._copies: dict[int, tuple[weakref.ref[nn.Module], nn.Module]] = {}
        compiled = compiled_module_type()
        modules = dict(root.named_modules())  # by name, in named_modules' order (one walk)
        _refuse_value_equal_modules(modules)
        for name, original in modules.items():
            if isinstance(original, compiled):
                raise TypeError(
                    f"fdp.functional_call: {'the module' if not name else repr(name)} is a "
                    "torch.compile'd module (OptimizedModule), whose compiled forward belongs "
                    "to the module it compiled: a call with other tensors would run on that "
                    "module's own. Compile around the functional call instead, e.g. "
                    "torch.compile(lambda params, x: fdp.functional_call(model, params, (x,))), "
                    "or use fdp.pmap(model, compile=True)."
                )
            if isinstance(original, torch.jit.ScriptModule):
                # Its forward runs on its C++ object, which holds its tensors and which every
                # copy shares: no copy of it can be private (nor made: refresh fails on its
                # dict wrappers with an AttributeError that names none of this).
                raise TypeError(
                    f"fdp.functional_call: {'the module' if not name else repr(name)} is a "
                    "scripted module (torch.jit.ScriptModule), whose forward runs on the "
                    "tensors held by its compiled C++ object: a private copy of it cannot be "
                    "given other tensors, so calls in several threads would see each other's. "
                    "Use the module before torch.jit.script instead, or call "
                    "torch.func.functional_call from one thread at a time."
                )
            copy = object.__new__(type(original))
            ref = weakref.ref(original)
            self._pairs.append((ref, copy))
            self._copies[id(original)] = (ref, copy)
        self.root = self._copies[id(root)][1]
        self.original = self._pairs[0][0]  # the module it copies (named_modules gives it first)
        # A parametrized module's class is made for it alone (torch.nn.utils.parametrize), and
        # the properties it injects there close over the module: a copy, an instance of that
        # class, refers to the module through its type. Kept so in the free list (a value of
        # the weak dictionary keyed by the module), the skeleton would keep the module, and its
        # tensors, alive for as long as the process runs; built anew on every call instead, it
        # cost a parametrized model half as much again. So an idle copy takes the class that
        # parametrize derived that one from (see clear), and its own back at refresh: here,
        # each such copy's index and that class.
        self._parked = [
            (i, type(original).__bases__[0])
            for i, original in enumerate(modules.values())
            if parametrize.is_parametrized(original)
        ]
        # Each copy's name in the tree (as named_modules gives it), for messages.
        self.names = list(modules)
        self._copy_list = [copy for _, copy in self._pairs]
        # Each copy's hook dicts of the last call where its original has none (see refresh),
        # else None; and all those dicts in one list, tested at once (see clear).
        self._hooks: list[dict[str, dict[Any, Any]] | None] = [None] * len(self._pairs)
        self._kept_hooks: list[dict[Any, Any]] = []
        # A module that torch.func.functional_call treats in a way of its own never takes the
        # direct swap (see by_path). (Nor does a scripted module: functional_call hands it to
        # torch, which refuses it, and elsewhere refresh fails on its dict wrappers.)
        self._direct_ok = not isinstance(root, nn.DataParallel)
        self.by_path: dict[str, nn.Module] | None = None
        # Every name of a tensor registered under several names (tied weights, a submodule
        # reached by several paths): the names of the tie and where each lives.
        self.tied: dict[str, _Tie] = {}
        # What by_path was worked out from (see refresh): the tree's shape, as names and ids.
        self._layout: tuple[list[Any], ...] | None = None
        # Where each name given to _swap_in lives under by_path: (module copy, leaf name).
        self.owners: dict[str, tuple[nn.Module, str]] = {}
        # What the copies' attributes were last found to be (see _watch_attributes).
        self._watch: _Watch | None = None
        # The values made for the copies' attributes in the last refresh (see _rebound).
        self._made: list[Any] = []

    def references(self) -> list[int]:
        """How many references each copy has: more after a call than before it means that
        something made during the call holds a copy (see :func:`_release`). So do the values
        made for the copies' attributes that reach them (a bound method of a copy, a partial
        of one), which can be held without a new reference to the copy (a checkpoint of
        ``self.act``, a partial of a method of the module, holds the partial)."""
        if self._made:
            return list(map(sys.getrefcount, chain(self._copy_list, self._made)))
        return list(map(sys.getrefcount, self._copy_list))

    def clear(self, *, released: bool = False) -> None:
        """Empties every copy; with ``released``, for good: any attribute looked up on a copy
        then raises an ``AttributeError`` that says why (see :class:`_Released`)."""
        for copy in self._copy_list:
            object.__setattr__(copy, "__dict__", {"_parameters": _Released()} if released else {})
        for index, base in self._parked:  # (see __init__)
            copy = self._copy_list[index]
            if type(copy).__bases__[0] is base:  # (not where its module's parametrizations went)
                object.__setattr__(copy, "__class__", base)
        self._made = []
        # The copies' hook dicts serve the next refresh only while empty: a hook that the call
        # left there would run in later calls, and could keep the module alive.
        if any(self._kept_hooks):
            self._hooks = [None if h is None or any(h.values()) else h for h in self._hooks]
            self._list_kept_hooks()

    def _list_kept_hooks(self) -> None:
        """Lists every hook dict that :attr:`_hooks` keeps, for :meth:`clear`'s test of them all."""
        self._kept_hooks = [d for h in self._hooks if h is not None for d in h.values()]

    def refresh(self) -> bool:
        """Copies the originals' current state in; False if the module tree changed shape.

        On the way, works out :attr:`by_path` (each submodule copy by every name it has) and
        :attr:`tied`, unless the tree holds a parametrization (left to torch's own call, to be
        safe), a cycle, or submodules shared inside each other so often that their paths would
        be too many to list.
        """
        direct = self._direct_ok
        copies = self._copies
        children_met: list[dict[str, Any]] = []  # the originals' children dicts, in order
        tensors_met: list[dict[str, Any]] = []  # their parameter and buffer dicts, in order
        states: list[dict[str, Any]] = []  # the copies' new attribute dicts, in order
        made: list[Any] = []  # the values made for them that reach the copies (see references)
        renewed = False  # whether a copy's hook dicts were made anew (see clear)
        for index, base in self._parked:  # each gets its module's class back (see __init__)
            original, copy = self._pairs[index][0](), self._copy_list[index]
            if original is not None and type(copy) is base and type(original).__bases__[0] is base:
                object.__setattr__(copy, "__class__", type(original))
        for index, (ref, copy) in enumerate(self._pairs):
            original = ref()
            if original is None:
                states.append({})  # (its copy is in no walk; the attribute check starts over)
                continue  # removed from the tree and collected
            if type(original) is not type(copy):
                return False  # its class was changed (module.__class__ = ...): built anew
            state = original.__dict__.copy()
            # Hook dicts of its own, holding the original's hooks: a hook that the call
            # registers (and removes) on the copy stays private to the call, as attributes
            # assigned on self do. Shared, it landed on the original, ran in the other
            # replicas' forwards too, and piled up there call after call. Where the original
            # has no hooks, the copy's empty dicts of the last call serve again (clear keeps
            # only empty ones): a dozen dict copies per module were a third of this method.
            kept, theirs = self._hooks[index], _hooks_of(state)
            hooked = any(theirs)
            if kept is not None and not hooked:
                state.update(kept)
            else:
                mine = dict(zip(_HOOK_KEYS, [hooks.copy() for hooks in theirs]))
                state.update(mine)
                if not hooked:
                    self._hooks[index] = mine
                    renewed = True
            parameters = state["_parameters"] = state["_parameters"].copy()
            buffers = state["_buffers"] = state["_buffers"].copy()
            children = state["_modules"]
            modules = state["_modules"] = {}
            for name, child in children.items():
                if child is None:
                    modules[name] = None
                    continue
                pair = copies.get(id(child))
                if pair is None or pair[0]() is not child:
                    return False  # added since the build (or a new module with a dead one's id)
                modules[name] = pair[1]
            object.__setattr__(copy, "__dict__", state)
            states.append(state)
            if direct:
                children_met.append(children)
                tensors_met += (parameters, buffers)
        # Attributes that would reach the originals (a bound method of a module of the tree,
        # say) get values of their own that reach the copies. Looking at every attribute of
        # every module costs as much again as the rest of this method: what was found is
        # kept, with the attributes' values where they can be kept (not the modules' own), and
        # compared in C; only modules with other values are looked at again on every call.
        watch = self._watch
        if watch is None or list(map(len, states)) != watch.lengths or not _same_values(watch, states):
            self._watch = _watch_attributes(states, copies, self.names, made)
        else:
            for index in watch.again:
                if _rebind_attributes(states[index], copies, self.names[index], made)[1] is not None:
                    self._watch = None  # its values can be kept now: worked out again next time
        self._made = made
        if renewed:
            self._list_kept_hooks()
        if direct:
            # Everything by_path depends on, as names and ids (of live originals, checked
            # above; ids keep nothing alive, and an idle skeleton must hold nothing). Equal to
            # the last call's, the usual case, by_path is still right: for a transformer of a
            # few dozen modules, not working it out again takes a third off this method.
            layout = (
                list(map(len, children_met)),
                list(chain.from_iterable(children_met)),
                list(map(id, chain.from_iterable(map(dict.values, children_met)))),
                list(map(len, tensors_met)),
                list(chain.from_iterable(tensors_met)),  # the tensors' names: :attr:`tied` has them
                list(map(id, chain.from_iterable(map(dict.values, tensors_met)))),
            )
            if layout != self._layout:
                self.by_path, self.tied = self._paths() or (None, {})
                self._layout = layout
                self.owners = {}
        return True

    def _paths(self) -> tuple[dict[str, nn.Module], dict[str, _Tie]] | None:
        """:attr:`by_path` and :attr:`tied` for the tree just refreshed, or None (see there).

        The walk lists a submodule, and its tensors, under every path that reaches it, as
        ``named_parameters(remove_duplicate=False)`` does, which is how
        ``torch.func.functional_call`` finds the names it ties."""
        by_path: dict[str, nn.Module] = {"": self.root}
        # Shared submodules multiply the paths; shared inside each other, exponentially (2**16
        # for one shared at 16 levels): past this many, the tree is left to torch.
        most = 64 * len(self._pairs) + 1024
        names: dict[int, list[tuple[str, nn.Module, str]]] = {}  # by tensor: its names
        walk: list[tuple[str, nn.Module, tuple[int, ...]]] = [("", self.root, ())]
        while walk:
            prefix, copy, above = walk.pop()
            state = copy.__dict__
            modules = state["_modules"]
            if "parametrizations" in modules:
                return None
            for slots in (state["_parameters"], state["_buffers"]):
                for leaf, tensor in slots.items():
                    if tensor is not None:
                        where = (f"{prefix}.{leaf}" if prefix else leaf, copy, leaf)
                        names.setdefault(id(tensor), []).append(where)
            above += (id(copy),)
            for name, child in modules.items():
                if child is None:
                    continue
                if id(child) in above:
                    return None  # a module inside itself: torch's walk would never end either
                path = f"{prefix}.{name}" if prefix else name
                by_path[path] = child
                walk.append((path, child, above))
            if len(by_path) > most:
                return None
        tied: dict[str, _Tie] = {}
        for places in names.values():
            if len(places) > 1:
                tie = (frozenset(name for name, _, _ in places), [(copy, leaf) for _, copy, leaf in places])
                for name, _, _ in places:
                    tied[name] = tie
        return by_path, tied


# nn.Module's own attributes (its hook dicts, its parameter, buffer and submodule dicts,
# ``training``): every other entry of a module's ``__dict__`` is its class's or its user's.
_MODULE_KEYS = frozenset(nn.Module().__dict__)

# nn.Module's hook dicts (forward, backward, state-dict ones): each copy gets its own (see refresh).
_HOOK_KEYS = tuple(
    key for key, value in nn.Module().__dict__.items() if "hook" in key and isinstance(value, dict)
)
_hooks_of = operator.itemgetter(*_HOOK_KEYS)  # a module's hook dicts, taken in one call

# Values that reach no module, which a skeleton may keep to compare with (see _Watch).
_INERT = frozenset(
    {int, float, bool, complex, str, bytes, type(None), range, torch.dtype, torch.device, torch.layout}
    | {torch.memory_format, torch.Size, torch.finfo, torch.iinfo}
)

# How deep _rebound looks into lists, tuples, dicts and partials within partials.
_DEPTH = 8


class _Unkept:
    """The stand-in, in a :class:`_Watch` snapshot, for a value that cannot be kept."""


_UNKEPT = _Unkept()


class _Watch:
    """What :func:`_watch_attributes` found about the attributes of a tree's modules (their
    ``__dict__`` entries other than nn.Module's own), in the order of the skeleton's copies.

    Where all of a module's attributes are inert (numbers, strings, tuples and lists of them,
    plain functions...), ``getters[i]`` takes them out of its ``__dict__`` and ``snapshots[i]``
    is what it took, lists and dicts copied: equal to it on a later call (with ``lengths``),
    nothing has changed, so nothing needs looking at. The others (a bound method, a tensor,
    any object that could refer to a module) cannot be kept by an idle skeleton, which must
    keep nothing alive: those modules, ``again``, are looked at on every call.
    """

    __slots__ = ("again", "getters", "lengths", "snapshots")

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.getters: list[Any] = []
        self.snapshots: list[Any] = []
        self.again: list[int] = []


def _same_values(watch: _Watch, states: list[dict[str, Any]]) -> bool:
    """Whether the modules' kept attributes are as :func:`_watch_attributes` found them."""
    try:
        return list(map(operator.call, watch.getters, states)) == watch.snapshots
    except Exception:  # a key deleted and another added, or a value whose == raises
        return False


def _watch_attributes(
    states: list[dict[str, Any]], copies: dict[int, Any], names: list[str], made: list[Any]
) -> _Watch:
    """Looks at every module's attributes: rebinds those that need it (see
    :func:`_rebind_attributes`), and notes how to tell cheaply that they did not change."""
    watch = _Watch()
    for index, state in enumerate(states):
        keys, snapshot = _rebind_attributes(state, copies, names[index], made)
        watch.lengths.append(len(state))
        if snapshot is None or not keys:
            watch.getters.append(len)  # (its length, compared anyway, stands in)
            watch.snapshots.append(len(state))
            if snapshot is None:
                watch.again.append(index)
        else:
            # (itemgetter of one key gives the value, not a tuple: asked twice, it gives a tuple.)
            watch.getters.append(
                operator.itemgetter(*keys) if len(keys) > 1 else operator.itemgetter(keys[0], keys[0])
            )
            watch.snapshots.append(tuple(snapshot) if len(keys) > 1 else (snapshot[0], snapshot[0]))
    return watch


def _rebind_attributes(
    state: dict[str, Any], copies: dict[int, Any], name: str, made: list[Any]
) -> tuple[list[str], list[Any] | None]:
    """Replaces, in ``state`` (a copy's ``__dict__``), each attribute that reaches a module of
    the tree with one that reaches its copy (see :func:`_rebound`). Returns the names of the
    attributes and, if all of them can be kept, what to compare them with later."""
    keys = []
    snapshot: list[Any] | None = []
    seen: dict[int, tuple[Any, Any]] = {}  # (see _rebound)
    for key, value in state.items():
        if key in _MODULE_KEYS:
            continue
        keys.append(key)
        new, kept = _rebound(value, copies, name, key, _DEPTH, made, seen)
        if new is not value:
            state[key] = new
        if kept is _UNKEPT:
            snapshot = None
        elif snapshot is not None:
            snapshot.append(kept)
    return keys, snapshot


def _copy_of(obj: Any, copies: dict[int, Any]) -> Any:
    """The skeleton's copy of ``obj`` if it is a module of the tree (and not a new object with a
    dead module's id), else None. (``refresh`` makes the same test inline, once per child.)"""
    pair = copies.get(id(obj))
    return pair[1] if pair is not None and pair[0]() is obj else None


def _rebound(
    value: Any,
    copies: dict[int, Any],
    name: str,
    path: _Path,
    depth: int,
    made: list[Any],
    seen: dict[int, tuple[Any, Any]],
) -> tuple[Any, Any]:
    """``value``, or a new one that reaches the skeleton's copies where ``value`` reaches the
    modules of the tree (which would run the original module, on its own tensors, where
    torch.func.functional_call, which swaps into the module itself, runs on the given ones),
    and what a snapshot of it compares equal to while it does not change (``_UNKEPT`` where
    it may not be kept: it could refer to a module, or is a tensor).

    Rebound: a module of the tree held as a plain attribute, a bound method of one (as
    ``types.MethodType(method.__func__, copy)``), a ``functools.partial`` whose function or
    arguments are rebound, a function whose closure holds one (a new function, with new
    cells for those: a ``nonlocal`` assignment to them in the call is dropped, as attributes
    assigned on the copy are), and lists, tuples and dicts of these (a copy, in the skeleton,
    with those items rebound: items the call appends to it are dropped). The same kinds of
    container of other types (``OrderedDict``, a namedtuple, a subclass of ``partial``) that
    hold one are refused, rather than rebuilt wrongly.
    """
    kind = type(value)
    if kind in _INERT or kind is types.FunctionType and value.__closure__ is None:
        return value, value
    if kind is types.BuiltinFunctionType and isinstance(value.__self__, (types.ModuleType, type(None))):
        return value, value  # torch.relu, len: no object of the user's behind it
    if isinstance(value, torch.Tensor):  # (the usual item of a list or dict looked at every call)
        return value, _UNKEPT
    if kind is types.MethodType:
        copy = _copy_of(value.__self__, copies)
        if copy is not None:
            method = types.MethodType(value.__func__, copy)
            made.append(method)
            return method, _UNKEPT
        return value, _UNKEPT
    if isinstance(value, nn.Module):
        copy = _copy_of(value, copies)
        return (value if copy is None else copy), _UNKEPT
    if isinstance(value, (type, enum.Enum)):
        return value, value
    if depth == 0:
        return value, _UNKEPT
    # What was found for each container met: one met again (a list inside itself, or shared
    # by several) is looked into once, not once per way to it (exponentially many).
    found = seen.get(id(value))
    if found is not None:
        return found
    seen[id(value)] = (value, _UNKEPT)  # (met again inside itself: left as it is)
    found = seen[id(value)] = _rebuilt(value, kind, copies, name, path, depth - 1, made, seen)
    return found


def _rebuilt(
    value: Any,
    kind: type,
    copies: dict[int, Any],
    name: str,
    path: _Path,
    depth: int,
    made: list[Any],
    seen: dict[int, tuple[Any, Any]],
) -> tuple[Any, Any]:
    """:func:`_rebound` for a container, a partial or a closure: what it holds, rebound."""
    if kind is list or kind is tuple:
        items = [
            _rebound(item, copies, name, (path, "[]", i), depth, made, seen) for i, item in enumerate(value)
        ]
        changed = any(new is not item for (new, _), item in zip(items, value))
        new_value = kind(new for new, _ in items) if changed else value
        if changed:
            made.append(new_value)
        kept = [kept for _, kept in items]
        return new_value, (_UNKEPT if any(k is _UNKEPT for k in kept) else kind(kept))
    if kind is dict:
        entries = {
            key: _rebound(item, copies, name, (path, "[]", key), depth, made, seen)
            for key, item in value.items()
        }
        changed = any(entries[key][0] is not item for key, item in value.items())
        new_value = {key: new for key, (new, _) in entries.items()} if changed else value
        if changed:
            made.append(new_value)
        unkept = any(kept is _UNKEPT for _, kept in entries.values())
        return new_value, (_UNKEPT if unkept else {key: kept for key, (_, kept) in entries.items()})
    if kind is functools.partial:
        func = _rebound(value.func, copies, name, (path, ".", "func"), depth, made, seen)[0]
        args = _rebound(value.args, copies, name, (path, ".", "args"), depth, made, seen)[0]
        keywords = _rebound(value.keywords, copies, name, (path, ".", "keywords"), depth, made, seen)[0]
        if func is value.func and args is value.args and keywords is value.keywords:
            return value, _UNKEPT
        new = functools.partial(func, *args, **keywords)
        new.__dict__.update(value.__dict__)
        made.append(new)
        return new, _UNKEPT
    if kind is types.FunctionType:
        cells = value.__closure__
        contents = [_cell_contents(cell) for cell in cells]
        rebound = [
            content
            if content is _UNKEPT
            else _rebound(content, copies, name, (path, ".", var), depth, made, seen)[0]
            for var, content in zip(value.__code__.co_freevars, contents)
        ]
        if all(new is old for new, old in zip(rebound, contents)):
            return value, _UNKEPT
        closure = tuple(
            cell if new is old else types.CellType(new) for cell, new, old in zip(cells, rebound, contents)
        )
        function = types.FunctionType(
            value.__code__, value.__globals__, value.__name__, value.__defaults__, closure
        )
        function.__kwdefaults__ = value.__kwdefaults__
        function.__qualname__ = value.__qualname__
        function.__dict__.update(value.__dict__)
        made.append(function)
        return function, _UNKEPT
    if isinstance(value, (list, tuple, dict, functools.partial)):
        inside = (
            value.values()
            if isinstance(value, dict)
            else value
            if not isinstance(value, functools.partial)
            else (value.func, *value.args, *value.keywords.values())
        )
        for item in inside:
            if _rebound(item, copies, name, path, depth, [], seen)[0] is not item:
                where = f"{name}.{_path_text(path)}" if name else _path_text(path)
                raise TypeError(
                    f"fdp.functional_call: module.{where} holds a module of the tree, or a bound "
                    "method, functools.partial or closure of one, inside an object of type "
                    f"{kind.__module__}.{kind.__qualname__}. Called on fdp's private copy of the "
                    "module, it would run the original module, on the module's own tensors instead "
                    "of the given ones; fdp.functional_call gives the copy one bound to the copy "
                    "only inside a plain list, tuple, dict or functools.partial, which it can "
                    "rebuild. Hold it in one of these, or call the method in forward "
                    "(self._impl(x)) instead of storing it."
                )
    return value, _UNKEPT


# Where _rebound is, under the attribute it started from: the attribute's name, or (where it
# is inside, "[]" or ".", the key or name there). Spelled out only for a message: a key's repr
# on every item of every call would cost more than the rest (and may fail).
_Path = str | tuple[Any, str, Any]


def _path_text(path: _Path) -> str:
    parts = []
    while isinstance(path, tuple):
        path, sep, item = path
        if sep == ".":
            parts.append(f".{item}")
        else:
            try:
                parts.append(f"[{item!r}]")
            except Exception:  # noqa: BLE001 (a key whose repr fails: named by its type)
                parts.append(f"[<{type(item).__name__}>]")
    return path + "".join(reversed(parts))


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a variable not yet assigned)
        return _UNKEPT


def compiled_module_type() -> type | tuple[()]:
    """The class of ``torch.compile``'d modules (``OptimizedModule``), for ``isinstance``; an
    empty tuple while torch._dynamo is not loaded (there is none then, and loading it takes
    seconds). Once it is loaded, read strictly: were torch to move the class, a compiled module
    would pass the checks that use this and run on its own module's tensors, silently."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return () if eval_frame is None else eval_frame.OptimizedModule


# Free skeletons by module. A weak dictionary finds its keys by == and hash: a module class that
# defines both by value (a dataclass with unsafe_hash=True) puts equal modules under one key, so
# each skeleton there is taken only for the module it was built from (see _checkout).
_FREE: weakref.WeakKeyDictionary[nn.Module, list[_Skeleton]] = weakref.WeakKeyDictionary()
_FREE_LOCK = threading.Lock()


def _fresh_lock_after_fork() -> None:
    # Fork copies only the forking thread: a lock another thread held then (a replica checking
    # out a skeleton) stays held in the child for good, and its first call would wait forever.
    global _FREE_LOCK
    _FREE_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_after_fork)


def _checkout(module: nn.Module) -> _Skeleton:
    with _FREE_LOCK:
        free = _FREE.get(module)
        skeleton = None
        if free:
            if free[-1].original() is module:  # (the usual case: one module under its key)
                skeleton = free.pop()
            else:  # another module equal to it: refreshed from that one, it would run as that one
                mine = [k for k, s in enumerate(free) if s.original() is module]
                skeleton = free.pop(mine[-1]) if mine else None
    if skeleton is None or not skeleton.refresh():
        skeleton = _Skeleton(module)
        skeleton.refresh()
    return skeleton


def _release(
    module: nn.Module, skeleton: _Skeleton, references: list[int] | None = None, *, keep: bool = False
) -> None:
    """Puts ``skeleton`` back in the free list, emptied, unless the call just made kept a
    reference to one of its copies (``references``: the counts before the call).

    What keeps one is mostly activation checkpointing (``torch.utils.checkpoint`` inside
    ``forward``): the autograd graph holds the checkpointed function, a method of a copy, to
    call it again in backward. Reused by a later call, or by another thread, the skeleton
    would then hold that call's tensors, and the recomputation would silently use them. Such a
    skeleton is never reused; with ``keep`` (the call's tensors are in the copies' own dicts)
    it is left as the call left it, so that the recomputation uses that call's tensors, as the
    forward did; else it is emptied, so that a recomputation fails rather than use others'.
    A full backward hook (``register_full_backward_hook``) holds its module in the graph too:
    modules with one get a new skeleton on every call (~3 µs per module), and so does a
    ``forward`` that stores ``self`` somewhere.
    """
    # A count that grew: something made during the call holds a copy (one that fell, say a
    # traceback of an earlier call let go, captures nothing).
    captured = references is not None and any(map(operator.gt, skeleton.references(), references))
    if captured and keep:
        return
    # An idle skeleton holds nothing: its copies' state (hook dicts, attribute values) could
    # otherwise refer back to the module and keep it, and the weak cache entry, alive forever.
    skeleton.clear(released=captured)
    if captured:
        return
    with _FREE_LOCK:
        free = _FREE.setdefault(module, [])
        if free and free[-1].original() is not module:
            # Modules equal to it share its key (see _FREE): those collected since leave their
            # skeletons here, for as long as the module of the key lives, unless dropped.
            free[:] = [s for s in free if s.original() is not None]
        free.append(skeleton)


class _Released(dict):  # type: ignore[type-arg]
    """The ``_parameters`` of a copy emptied while something still held it (see
    :func:`_release`), empty like the others. ``nn.Module.__getattr__`` looks every missing
    attribute up in it first: that lookup raises an ``AttributeError`` that says why, so a
    later use of the copy, such as a checkpoint's recomputation, does not fail naming a
    missing ``_backward_hooks``. Every other test of membership (``nn.Module.__setattr__``'s,
    say, for a backward hook that sets an attribute on its module) finds nothing, as in an
    empty dict."""

    def __contains__(self, name: object) -> bool:
        if sys._getframe(1).f_code is not _MODULE_GETATTR:
            return False
        raise AttributeError(
            f"fdp.functional_call: no attribute {name!r}: this module is a private copy that "
            "fdp.functional_call lent to a call that has returned, emptied so that it cannot "
            "run on another call's tensors. Something made during the call kept it and used it "
            "later: most likely activation checkpointing (torch.utils.checkpoint) inside "
            "forward, recomputing in backward, or a backward hook. fdp.functional_call supports "
            "checkpointing, except where it leaves the call to torch.func.functional_call: a "
            "module with parametrizations (torch.nn.utils.parametrize), params given as a "
            "sequence of dicts, strict=True, names that are not the module's parameters or "
            "buffers, and values that are neither tensors nor None. There, checkpoint the "
            "whole functional call from outside, or (but for parametrizations) pass one dict "
            "of the module's parameters and buffers."
        )


_MODULE_GETATTR = nn.Module.__getattr__.__code__


class private_module:
    """A private skeleton of ``module`` for the block (see the module docstring): what is
    swapped or assigned into it is seen by no other thread, and dropped at the end."""

    __slots__ = ("_module", "_skeleton")

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __enter__(self) -> nn.Module:
        self._skeleton = _checkout(self._module)
        return self._skeleton.root

    def __exit__(self, *exc: object) -> None:
        _release(self._module, self._skeleton)


def swapped_call(module: nn.Module, params: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``torch.func.functional_call`` on ``module`` itself: for a private module (above), in
    code that ``torch.compile`` compiles (graph breaks inside the forward included)."""
    return torch.func.functional_call(module, params, args, kwargs)


def functional_call(
    module: nn.Module,
    params: dict[str, Any] | Sequence[dict[str, Any]],
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    tie_weights: bool = True,
    strict: bool = False,
) -> Any:
    """Calls ``module`` with its parameters and buffers replaced by ``params``; safe in threads.

    A drop-in for :func:`torch.func.functional_call` that any number of threads may call on the
    same module at once: the tensors are swapped into a private skeleton of the module, never
    into ``module`` itself. Works inside ``torch.func.grad``/``vmap`` and inside functions
    mapped by :func:`fdp.pmap`. Under ``torch.compile`` it traces to
    :func:`torch.func.functional_call`, whose swap the compiler turns into graph inputs; the
    module's forward must then compile without graph breaks (a break raises
    ``torch._dynamo.exc.Unsupported`` naming it), and attributes that ``forward`` assigns on
    ``self`` land on ``module``. ``fdp.pmap(module, compile=True)`` has neither limit.

    Activation checkpointing inside ``forward`` (``torch.utils.checkpoint``) recomputes with
    the call's own tensors in backward, also while other calls of the module run in other
    threads: a skeleton that the autograd graph still holds is never reused. (Where
    ``torch.func.functional_call``'s own swap runs on the skeleton and is undone when it
    returns, on parametrized modules, a sequence of dicts, ``strict=True``, names that are not
    the module's parameters or buffers, or values that are neither tensors nor None, such a
    recomputation raises an error that says so; on the module itself,
    ``torch.func.functional_call`` would recompute with the module's own tensors.) Tied weights
    and submodules under two names are swapped as ``torch.func.functional_call`` swaps them,
    but the module never keeps a given tensor (torch 2.13 leaves one in a submodule reached by
    two names: pytorch/pytorch#164759).
    A submodule that ``forward`` reaches only through a plain attribute (a list of modules
    not registered as children, say) is the original, not the skeleton's copy, and keeps its
    own tensors, as with ``nn.DataParallel``'s replicas; register it (``nn.ModuleList``).
    An attribute that would reach a module of the tree itself (a bound method such as
    ``self.act = self._impl``, a ``functools.partial`` or closure of one, and plain lists,
    tuples and dicts of these) reaches the skeleton's copy instead, as ``torch.func.functional_call``
    runs it on the given tensors; inside a container of another type it raises ``TypeError``.

    Inside a pmapped function with several replicas, the module's own buffers (those ``params``
    leaves out) are shared by the replicas: a ``forward`` that changes one in place (BatchNorm's
    running statistics in training mode) raises ``RuntimeError`` naming it, where the replicas'
    updates would race. Give the buffers (:func:`fdp.stateful_call`), or use evaluation mode.
    (A shared :class:`fdp.SyncBatchNorm` is no error: its replicas write one update.)

    Args:
        module: the module to call. It is not modified.
        params: a dict from parameter and buffer names (as in ``module.named_parameters()``) to
            tensors, or a sequence of such dicts. Names it does not mention keep the module's own
            tensors.
        args: the positional arguments for ``forward``; a single non-tuple value is passed as
            the only argument. Default: ``()``.
        kwargs: the keyword arguments for ``forward``. Default: ``None`` (none).
        tie_weights: as in :func:`torch.func.functional_call`: tensors tied in ``module`` stay
            tied to the value given for any of their names. Keyword-only. Default: ``True``.
        strict: as in :func:`torch.func.functional_call`: require exactly the module's
            parameters and buffers in ``params``. Keyword-only. Default: ``False``.

    Returns:
        What ``module.forward`` returns.

    Examples:
        >>> import torch, fdp
        >>> layer = torch.nn.Linear(3, 1)
        >>> params = {"weight": torch.ones(1, 3), "bias": torch.zeros(1)}
        >>> fdp.functional_call(layer, params, (torch.tensor([[1.0, 2.0, 3.0]]),))
        tensor([[6.]])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fdp.functional_call: module must be a torch.nn.Module, got {type(module).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        # Refused by forward's call, in words that name the module but neither this call nor
        # the argument ("Linear(...) argument after ** must be a mapping, not list").
        raise TypeError(
            "fdp.functional_call: kwargs must be a dict of keyword arguments for forward or None, "
            f"got {type(kwargs).__name__}: {_tree.short_repr(kwargs)}"
        )
    # torch.compiler.is_compiling() is True only while torch.compile traces this call, when the
    # compiler is loaded.
    if torch.compiler.is_compiling():
        # Compiled in one piece, torch.func.functional_call's swap becomes graph inputs and
        # never touches the module, so threads stay independent (the skeleton cache's lock
        # would break the graph). A graph break inside it would make the swap real, into the
        # shared module: refused, loudly, instead.
        with torch._dynamo.error_on_graph_break(True):
            return torch.func.functional_call(
                module, params, args, kwargs, tie_weights=tie_weights, strict=strict
            )
    if isinstance(module, torch.jit.ScriptModule):  # torch refuses it, saying why
        return torch.func.functional_call(
            module, params, args, kwargs, tie_weights=tie_weights, strict=strict
        )
    skeleton = _checkout(module)
    references, keep = None, False
    try:
        swapped = None if strict or torch.jit.is_tracing() else _swap_in(skeleton, params, tie_weights)
        references = skeleton.references()
        if swapped is None:
            if not isinstance(params, (dict, list, tuple)):
                # What torch.func.functional_call takes; its own words ("Expected
                # parameter_and_buffer_dicts to be a dict ...") name neither call nor argument.
                raise TypeError(
                    "fdp.functional_call: params must be a dict of tensors by name (or a sequence "
                    f"of such dicts), got {type(params).__name__}: {_tree.short_repr(params)}"
                )
            if skeleton.by_path is None:  # (worked out, it says the tree has no parametrization)
                _own_originals(skeleton.root, params)
            context = _replica.current()
            # The own buffers race here as below: a spectral_norm parametrization's power
            # iteration updates its _u and _v in place in training mode.
            shared = _own_buffers(skeleton, params) if context is not None and context.size > 1 else None
            result = torch.func.functional_call(
                skeleton.root, params, args, kwargs, tie_weights=tie_weights, strict=strict
            )
            if shared:
                _check_own_buffers(shared, context)
            return result
        keep = True
        context = _replica.current()
        # Replicas running at once share the module's own buffers (those params does not give):
        # an in-place update there (BatchNorm's running statistics in training mode) races.
        shared = _own_buffers(skeleton, params) if context is not None and context.size > 1 else None
        try:
            result = skeleton.root(*(args if isinstance(args, tuple) else (args,)), **(kwargs or {}))
        finally:
            _write_back(swapped, params)  # type: ignore[arg-type]
        if shared:
            _check_own_buffers(shared, context)
        return result
    except BaseException:
        references = None  # a failed call leaves no graph behind (its traceback holds copies)
        raise
    finally:
        _release(module, skeleton, references, keep=keep)


_Swapped = list[tuple[str, dict[str, Any], str, Any]]


def _own_buffers(skeleton: _Skeleton, params: Any) -> list[tuple[str, torch.Tensor, int]]:
    """The module's own buffers in the skeleton (those ``params`` does not give), with their
    names and version counters, after the swap. (Before torch.func.functional_call's own swap,
    a buffer that ``params`` gives is listed too, as the module's tensor that it is then: the
    call swaps it out, and its version never moves.)"""
    # (A sequence of dicts, which torch.func.functional_call also takes, gives each dict's.)
    groups = params if isinstance(params, (list, tuple)) else [params]
    given = {id(value) for group in groups if isinstance(group, dict) for value in group.values()}
    own = []
    for prefix, copy in zip(skeleton.names, skeleton._copy_list):
        # Buffers a layer's replicas update with one same value each (fdp.SyncBatchNorm's
        # statistics, by design: see there) race with nothing. (Looked up on the class: a
        # module's own __getattr__ would raise for every other module.)
        alike = getattr(type(copy), "_replicas_write_alike", ())
        for leaf, tensor in copy.__dict__.get("_buffers", {}).items():
            # (Inference tensors keep no version counter, and cannot change outside inference mode.)
            if tensor is None or id(tensor) in given or leaf in alike or tensor.is_inference():
                continue
            own.append((f"{prefix}.{leaf}" if prefix else leaf, tensor, tensor._version))
    return own


def _check_own_buffers(own: list[tuple[str, torch.Tensor, int]], context: Any) -> None:
    changed = [name for name, tensor, version in own if tensor._version != version]
    if changed:
        raise RuntimeError(
            f"fdp.functional_call: forward changed the module's own buffer{'s' if len(changed) > 1 else ''} "
            f"{', '.join(map(repr, changed[:4]))}{' and more' if len(changed) > 4 else ''} in place, in "
            f"replica {context.index} of {context.size}, but the replicas share the module's own "
            "buffers (params does not give them): their updates race and are lost, silently. Pass "
            "the buffers in and take the new values back with fdp.stateful_call (BatchNorm's "
            "running statistics in training mode, say), or call the module in evaluation mode."
        )


def _swap_in(skeleton: _Skeleton, params: Any, tie_weights: bool) -> _Swapped | None:
    """Puts ``params`` into the skeleton's own dicts, as torch.func.functional_call's swap does,
    without its Python work for strict checks and the restore (the skeleton is private, and
    refreshed at its next checkout). With ``tie_weights``, a tensor given for one name of a
    tied tensor goes under each of its names, as there. None, with nothing changed, where that
    call's own handling is needed: a sequence of dicts, a tree that :meth:`_Skeleton.refresh`
    found parametrizations or a cycle in, a name that is not a parameter or buffer, a value
    that is not a tensor or None, several names of one tied tensor given different values
    (torch refuses them, saying why) or some but not all of its names given.

    For a transformer of a few dozen tensors this saves ~0.5 ms of Python per call, which
    replicas running in threads would otherwise take turns for (the GIL).
    """
    by_path = skeleton.by_path
    if by_path is None or type(params) is not dict:
        return None
    owners = skeleton.owners  # kept while by_path is: the name's owner and leaf, worked out once
    tied = skeleton.tied if tie_weights else None
    swapped: _Swapped = []
    also: list[tuple[list[tuple[nn.Module, str]], Any]] = []  # a tied tensor's other names
    for name, value in params.items():
        if value is not None and not isinstance(value, torch.Tensor):
            return None
        found = owners.get(name)
        if found is None:
            prefix, _, leaf = name.rpartition(".")
            owner = by_path.get(prefix)
            if owner is None:
                return None
            if len(owners) > 4096:  # names made up call by call: keep the cache small
                owners.clear()
            found = owners[name] = (owner, leaf)
        owner, leaf = found
        state = owner.__dict__  # _slots_of, inline: this loop runs for every name of every call
        slots = state["_parameters"]
        if leaf not in slots:
            slots = state["_buffers"]
            if leaf not in slots:
                return None
        swapped.append((name, slots, leaf, value))
        if tied:
            tie = tied.get(name)
            if tie is not None:
                names, places = tie
                given = [params[other] for other in names if other in params]
                if len(given) == 1:  # this name alone: the tensor goes under each of the tie's
                    also.append((places, value))
                elif len(given) < len(names) or any(v is not value for v in given):
                    return None  # several names given: torch's rules (and errors) decide
                # (Every name given one tensor: each is swapped in under its own name above.)
    for _, slots, leaf, value in swapped:
        slots[leaf] = value
    for places, value in also:
        for owner, leaf in places:
            slots = _slots_of(owner, leaf)
            assert slots is not None, leaf  # the layout, names included, is that of the tie
            slots[leaf] = value
    return swapped


def _refuse_value_equal_modules(distinct: dict[str, nn.Module]) -> None:
    """Refuses a tree in which two distinct submodules compare equal (a module class with
    ``__eq__`` and ``__hash__`` by value, e.g. ``@dataclass(unsafe_hash=True)``); ``distinct``
    is the tree's ``dict(named_modules())``.

    ``named_modules()`` skips modules already seen by looking them up in a set, which finds
    them by ``==``: it yields only the first of the two, and ``named_parameters()``,
    ``state_dict()`` and every copy made from them miss the other's tensors (calls failed
    with a bare ``KeyError: '_modules'``).
    """
    seen = {id(module) for module in distinct.values()}
    # (A child that is not among them was skipped as equal to one seen before. Not a second
    # walk with remove_duplicate=False: that one never ends on a module inside itself.)
    for parent_name, parent in distinct.items():
        for child_name, module in parent.__dict__["_modules"].items():
            if module is None or id(module) in seen:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            first = next(other_name for other_name, other in distinct.items() if other == module)
            raise TypeError(
                f"fdp.functional_call: the submodules {first!r} and {name!r} are distinct "
                f"{type(module).__qualname__} objects that compare equal (their class defines "
                "__eq__ and __hash__ by value), and torch's named_modules() takes them for one: "
                f"the tensors of {name!r} are missing from named_parameters() and state_dict(), "
                "so no copy of the module can hold them. Compare modules by identity (for a "
                "dataclass: @dataclass(eq=False))."
            )


def _own_originals(root: nn.Module, params: Any) -> None:
    """Gives the skeleton its own tensors for the originals of each parametrized tensor that
    ``params`` names by its parametrized name (``"weight"``, not
    ``"parametrizations.weight.original"``).

    torch.func.functional_call sets such a tensor through the parametrization's
    ``right_inverse``, which writes the result into the original in place (``Tensor.set_``).
    The copies share the module's originals: other threads would read (or crash on) the
    tensor set, and the module would come back with other storage and a bumped version
    counter. Fresh tensors that share the originals' data take the write instead; gradients
    of such a call reach neither the module nor the given tensor (``right_inverse`` runs
    without grad; torch's call would accumulate them in the module's original's ``.grad``).
    """
    dicts = [params] if isinstance(params, dict) else params if isinstance(params, Sequence) else ()
    dicts = [given for given in dicts if isinstance(given, dict)]  # torch refuses others, saying why
    names = {name for given in dicts for name in given if isinstance(name, str)}
    for given in dicts:
        for name in given:
            if not isinstance(name, str):
                continue
            prefix, _, leaf = name.rpartition(".")
            owner: Any = root
            for part in prefix.split(".") if prefix else ():
                owner = owner.__dict__["_modules"].get(part) if isinstance(owner, nn.Module) else None
            if not isinstance(owner, nn.Module) or not parametrize.is_parametrized(owner, leaf):
                continue
            # Its originals given too (a full state dict with "weight" added; fdp.pmap(module)
            # completes params so): torch swaps them in, then sets the given one in place, and
            # puts back (by value) only what the skeleton held. A fresh one there would leave
            # the given original, often the module's own, holding the parametrized value.
            originals_prefix = f"{prefix}.parametrizations.{leaf}." if prefix else f"parametrizations.{leaf}."
            if any(other.startswith(originals_prefix) for other in names):
                continue
            originals = owner.__dict__["_modules"]["parametrizations"].__dict__["_modules"][leaf]
            for slots in (originals.__dict__["_parameters"], originals.__dict__["_buffers"]):
                for key, tensor in slots.items():
                    if tensor is None:
                        continue
                    with torch.no_grad():  # its data, not its version counter (as detach's)
                        fresh = tensor.new_empty(0).set_(tensor)
                    is_parameter = isinstance(tensor, nn.Parameter)
                    slots[key] = nn.Parameter(fresh, tensor.requires_grad) if is_parameter else fresh


def _slots_of(owner: nn.Module, leaf: str) -> dict[str, Any] | None:
    """The dict of ``owner`` (a skeleton copy) that holds the parameter or buffer ``leaf``."""
    state = owner.__dict__
    slots = state["_parameters"]
    if leaf in slots:
        return slots
    slots = state["_buffers"]
    return slots if leaf in slots else None


def _write_back(swapped: _Swapped, params: dict[str, Any]) -> None:
    """What torch.func.functional_call does after the call: a tensor that ``forward``
    reassigned (rather than changed in place) goes back into the caller's dict."""
    for name, slots, leaf, value in swapped:
        current = slots.get(leaf, value)
        if current is not value:
            params[name] = current


def stateful_call(
    module: nn.Module,
    params: dict[str, Any],
    buffers: dict[str, torch.Tensor],
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Calls ``module`` functionally and returns its updated buffers as new state.

    Layers such as BatchNorm update their buffers (running statistics) in place during
    ``forward``. Here they update fresh copies, which come back as ``new_buffers`` (as do
    buffers that ``forward`` reassigns rather than changes in place); neither
    ``buffers`` nor the module is ever modified. Buffers that ``buffers`` does not name are
    copied from ``params`` where it names them (a dict of both, as for
    :func:`functional_call`), else from the module, so ``new_buffers`` always holds every
    buffer of the module. In a
    pmapped training step, each replica gets its own new statistics: keep them per replica, or
    average them with :func:`fdp.pmean` (over the floating-point buffers). Nothing is silently
    taken from replica 0.

    Args:
        module: the module to call. It is not modified.
        params: parameters by name (may be differentiated with ``torch.func``).
        buffers: buffers by name, as in ``dict(module.named_buffers())``; missing ones are taken
            from ``params`` where it names them, else from the module.
        args: the positional arguments for ``forward``. Default: ``()``.
        kwargs: the keyword arguments for ``forward``. Default: ``None``.

    Returns:
        ``(output, new_buffers)``.

    Examples:
        >>> import torch, fdp
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> buffers = dict(bn.named_buffers())
        >>> out, new = fdp.stateful_call(bn, dict(bn.named_parameters()), buffers, (torch.randn(4, 2),))
        >>> int(new["num_batches_tracked"]), int(buffers["num_batches_tracked"])
        (1, 0)
    """
    if not isinstance(module, nn.Module):  # named_buffers() would fail naming nothing
        raise TypeError(f"fdp.stateful_call: module must be a torch.nn.Module, got {type(module).__name__}")
    own = dict(module.named_buffers())
    # A buffer that ``params`` names (a dict of both, as torch.func.functional_call takes) is
    # the caller's value: taken from the module instead, it would silently replace it.
    try:
        everything = {**own, **{name: params[name] for name in own if name in params}, **buffers}
        given = {**params}
    except TypeError:
        # None for buffers (or params) said only "'NoneType' object is not a mapping" (params
        # of a module without buffers, or a list of dicts, only here).
        for what, value in (("params", params), ("buffers", buffers)):
            if not isinstance(value, Mapping):
                raise TypeError(
                    f"fdp.stateful_call: {what} must be a dict of tensors by name, got "
                    f"{type(value).__name__}: {_tree.short_repr(value)}"
                ) from None
        raise
    # Cloned outside the try: a tensor subclass's clone() that raises a TypeError is its own
    # error, not one of params or buffers.
    # (None, given in params to run without that buffer, as torch.func.functional_call takes
    # it, stays None; a value that is not a tensor reaches torch, which says why it is refused.)
    new_buffers = {name: b.clone() if isinstance(b, torch.Tensor) else b for name, b in everything.items()}
    given.update(new_buffers)
    output = functional_call(module, given, args, kwargs)
    # A buffer that forward reassigned (self.count = self.count + 1) came back in ``given``.
    return output, {name: given[name] for name in new_buffers}

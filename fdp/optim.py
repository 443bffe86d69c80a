"""Functional optimizers on pytrees (optax-style ``init``/``update`` pairs) matching ``torch.optim``.

>>> import torch
>>> from fdp import optim
>>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adam(1e-2))
>>> params = {"w": torch.zeros(3)}
>>> state = opt.init(params)
>>> params, state = opt.apply_gradients({"w": torch.ones(3)}, state, params)  # one step
>>> updates, state = opt.update({"w": torch.ones(3)}, state, params)  # or optax's two
>>> params = optim.apply_updates(params, updates)
"""

from ._optim import (
    AdamState,
    EmptyState,
    GradientTransformation,
    MultiTransformState,
    Schedule,
    SgdState,
    TransformUpdateFn,
    adam,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    multi_transform,
    sgd,
)

__all__ = [
    "AdamState",
    "EmptyState",
    "GradientTransformation",
    "MultiTransformState",
    "Schedule",
    "SgdState",
    "TransformUpdateFn",
    "adam",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "multi_transform",
    "sgd",
]

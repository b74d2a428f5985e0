"""Param groups by role, as weight-decay recipes split a model: weights, biases, normalisation layers and
embeddings, each with a constraint of its own (or none).

    groups = fgfw.param_groups(model, weights=fgfw.KSparsePolytope.from_init_diameter(1.0, k=100))
    opt = fgfw.FrankWolfe(groups, constraint=fgfw.L1Ball(radius=1.0))  # constraint: the default of a group

A parameter's role comes from the module that holds it (the first one met in ``model.modules()``, so a
weight tied between an embedding and an output layer is the embedding's) and from its dimension:

* ``embeddings``: parameters of ``nn.Embedding`` and ``nn.EmbeddingBag``;
* ``norms``: parameters of normalisation layers: torch's batch, layer, group, instance, RMS and local
  response norms and any module whose class name ends in ``Norm`` (Hugging Face's ``LlamaRMSNorm``, ...);
* ``biases``: the other parameters of fewer than two dimensions;
* ``weights``: the other parameters of two or more dimensions (linear and convolution weights, Hugging
  Face's ``Conv1D``).

Frozen parameters (``requires_grad=False``) are left out. A role given ``None`` gets the group option
``constraint=None``: its parameters are unconstrained and take a plain (stochastic) gradient step, as
documented in ``docs/algorithms.md``. The model's modules are registered for the radius rules, so a
zero-initialised tensor takes its radius from draws of its module's initialisation
(:meth:`fgfw.Constraint.resolve_radii`).
"""
from __future__ import annotations

from torch import nn

from .constraints import Constraint, register_modules

ROLES = ("weights", "biases", "norms", "embeddings")
_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
               getattr(nn, "RMSNorm", nn.LayerNorm))
_EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


def role_of(module: nn.Module, p) -> str:
    """The role (a name in ROLES) of parameter ``p`` held by ``module``."""
    if isinstance(module, _EMBEDDING_TYPES):
        return "embeddings"
    if isinstance(module, _NORM_TYPES) or type(module).__name__.endswith("Norm"):
        return "norms"
    return "biases" if p.dim() < 2 else "weights"


def _group_options(role: str, spec) -> dict:
    if spec is None or isinstance(spec, Constraint):
        return {"constraint": spec}
    if isinstance(spec, dict):
        if "params" in spec:
            raise ValueError(f"{role}: a dict of group options must not hold 'params' (param_groups fills them in)")
        constraint = spec.get("constraint")
        if "constraint" in spec and constraint is not None and not isinstance(constraint, Constraint):
            raise TypeError(f"{role}['constraint'] must be an fgfw constraint or None, got {type(constraint).__name__}")
        return dict(spec)
    raise TypeError(f"{role} must be an fgfw constraint (e.g. fgfw.L1Ball(radius=1.0)), None (unconstrained) or a "
                    f"dict of group options, got {type(spec).__name__}")


def param_groups(model: nn.Module, *, weights, biases=None, norms=None, embeddings=None) -> list[dict]:
    """``model``'s trainable parameters as param groups by role (see the module docstring).

    Each role takes a constraint, ``None`` (unconstrained: a plain gradient step) or a dict of group options
    (``{"constraint": ..., "step_size": ...}``). Returns one group per role that has parameters, in the
    order of ROLES; each group's ``"role"`` names it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    options = {role: _group_options(role, spec) for role, spec in
               zip(ROLES, (weights, biases, norms, embeddings))}
    register_modules(model)
    by_role = {role: [] for role in ROLES}
    seen = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            by_role[role_of(module, p)].append(p)
    return [dict(options[role], params=params, role=role) for role, params in by_role.items() if params]

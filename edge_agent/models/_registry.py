"""The model registry: zoo names, users' factories (``package.module:function``), and the check
that a model built either way has the interface every fedfleet algorithm relies on."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from edge_agent.errors import ModelError
from edge_agent.plugins import entry_point_names, import_object, is_import_path, resolve_reference

from .training import drop_batch_counters

__all__ = [
    "MODEL_KEYWORDS",
    "build_model",
    "check_model",
    "is_factory_path",
    "list_models",
    "make_model",
    "register_model",
    "resolve_model",
]

#: The keywords a model constructor or a user's factory is called with (those it accepts).
MODEL_KEYWORDS = ("in_channels", "image_size", "num_classes", "feature_dim")

_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Class/function decorator that registers a model constructor under ``name``.

    Raises:
        ModelError: ``name`` is already registered, or is not a non-empty lower-case string.
    """
    if not isinstance(name, str) or not name or name != name.lower() or ":" in name:
        raise ModelError(f"model names must be non-empty lower-case strings without ':', got {name!r}")

    def decorator(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _MODELS:
            raise ModelError(f"model name {name!r} is already registered")
        _MODELS[name] = factory
        return factory

    return decorator


def list_models() -> list[str]:
    """Return the registered (zoo) model names, sorted."""
    return sorted(_MODELS)


def is_factory_path(name: object) -> bool:
    """True when ``name`` reads as a user's factory ``package.module:function``
    (:func:`edge_agent.plugins.is_import_path`)."""
    return is_import_path(name)


def resolve_model(name: str) -> Callable[..., nn.Module]:
    """The constructor behind a model name: a zoo entry, or a user's factory imported from
    ``package.module:function`` (the module is imported; nothing is built).

    A name that is neither a zoo name nor an import path is looked up among the installed entry
    points of group ``fedfleet.models`` (:mod:`edge_agent.plugins`).

    Raises:
        ModelError: an unknown name (the message lists the zoo and the installed entry points), a
            malformed factory path, a module that cannot be imported, a missing attribute, or one
            that is not callable.
    """
    if not isinstance(name, str) or not name:
        raise ModelError(f"a model name must be a non-empty string, got {name!r}")
    if not is_factory_path(name):
        if name in _MODELS:
            return _MODELS[name]
        if name not in entry_point_names("model"):
            installed = entry_point_names("model")
            raise ModelError(f"unknown model {name!r}; the zoo has {', '.join(list_models())}"
                             + (f", the installed entry points (group fedfleet.models) {', '.join(installed)}"
                                if installed else "")
                             + ", or give your own factory as 'package.module:function' (or install a package "
                               "that declares it as an entry point of group fedfleet.models)")
        obj = resolve_reference(name, kind="model", what="model factory", error=ModelError)
        if not callable(obj):
            raise ModelError(f"model factory {name!r} (entry point): a {type(obj).__name__}, not callable")
        return obj
    obj = import_object(name, what="model factory", error=ModelError, form="package.module:function")
    if not callable(obj):
        raise ModelError(f"model factory {name!r}: {name.partition(':')[2]!r} is a {type(obj).__name__}, "
                         "not callable")
    return obj


def _accepted(factory: Callable[..., object], kwargs: dict[str, object]) -> dict[str, object]:
    """The subset of ``kwargs`` that ``factory``'s signature takes (all of them with ``**kw``)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: give it everything
        return dict(kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(kwargs)
    names = {p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return {k: v for k, v in kwargs.items() if k in names}


def build_model(name: str = "lightcnn", **kwargs: object) -> nn.Module:
    """Construct a model by zoo name or from a user's factory ``package.module:function``.

    Args:
        name: one of :func:`list_models` (default ``"lightcnn"``), or ``"package.module:function"``.
        **kwargs: keyword arguments of the constructor (``in_channels=3, image_size=32,
            num_classes=10, feature_dim=64`` for every zoo model). A zoo constructor gets them
            all (an unknown one is an error); a user's factory only those its signature accepts.

    Returns:
        A freshly initialised model (float32 parameters, on the CPU, in training mode). Not
        checked: :func:`make_model` builds and checks.

    Raises:
        ModelError: unknown name (the message lists the known ones), a factory that cannot be
            imported or called, an unknown keyword, or invalid architecture arguments.
    """
    factory = resolve_model(name)
    user = name not in _MODELS  # a user's factory: an import path or an entry point
    if user:
        kwargs = _accepted(factory, kwargs)
    try:
        model = factory(**kwargs)
    except ModelError:
        raise
    except TypeError as exc:
        raise ModelError(f"bad arguments for model {name!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 — a user's factory failing is reported as a misfit
        if not user:
            raise
        raise ModelError(f"model factory {name!r} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ModelError(f"model {name!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _shape_text(value: object) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


def check_model(model: nn.Module, *, in_channels: int, image_size: int, num_classes: int, feature_dim: int,
                name: str = "model") -> None:
    """Check that ``model`` has the interface of :class:`~edge_agent.models.LightCNN`.

    Required: methods ``features(x)`` (float32 ``[N, C, S, S]`` -> ``[N, feature_dim]``, the
    prototype) and ``head(z)`` (``[N, feature_dim]`` -> logits ``[N, num_classes]``), ``forward``
    giving the logits, and a ``classifier.weight`` state entry of shape ``[num_classes,
    feature_dim]`` (the head that FedPer/FedRep keep and prototype methods read). Checked on a
    dummy batch of two zero images in eval mode without gradients; the model's mode is restored
    and its BatchNorm running statistics are untouched.

    Raises:
        ModelError: naming ``name`` and what does not fit (a missing method, a call that fails,
            an output of another shape, a feature width other than ``feature_dim``).
    """
    if not isinstance(model, nn.Module):
        raise ModelError(f"{name}: got a {type(model).__name__}, not a torch.nn.Module")
    missing = [m for m in ("features", "head") if not callable(getattr(model, m, None))]
    if missing:
        raise ModelError(f"{name}: the model has no {' and no '.join(f'{m}()' for m in missing)}; a fedfleet model "
                         "needs features(x) -> [N, feature_dim] and head(z) -> [N, num_classes] "
                         "(see edge_agent.models.LightCNN)")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            x = torch.zeros(2, in_channels, image_size, image_size)
            where = f"[2, {in_channels}, {image_size}, {image_size}]"
            # nn.Module's __getattr__ types these as Tensor | Module; callable() was checked above
            features = cast(Callable[[torch.Tensor], torch.Tensor], model.features)
            head = cast(Callable[[torch.Tensor], torch.Tensor], model.head)
            try:
                z = features(x)
            except Exception as exc:  # noqa: BLE001 — any failure of user code is reported as a misfit
                raise ModelError(f"{name}: features(x) failed on a dummy batch {where}: {exc}") from exc
            if not isinstance(z, torch.Tensor) or tuple(z.shape) != (2, feature_dim):
                width = f" (feature width {z.shape[-1]})" if isinstance(z, torch.Tensor) and z.dim() == 2 else ""
                raise ModelError(f"{name}: features(x) gave {_shape_text(z)}{width} for x {where}; expected "
                                 f"[2, {feature_dim}], the agreed feature width ([model] feature_dim)")
            try:
                logits = head(z)
                out = model(x)
            except Exception as exc:  # noqa: BLE001
                raise ModelError(f"{name}: head(z) or forward(x) failed on a dummy batch: {exc}") from exc
            for label, value in (("head(features(x))", logits), ("forward(x)", out)):
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != (2, num_classes):
                    raise ModelError(f"{name}: {label} gave {_shape_text(value)}; expected [2, {num_classes}] "
                                     f"logits ({num_classes} classes in the data set)")
    finally:
        model.train(was_training)
    w = model.state_dict().get("classifier.weight")
    if w is None or tuple(w.shape) != (num_classes, feature_dim):
        got = "no classifier.weight entry" if w is None else f"classifier.weight {list(w.shape)}"
        raise ModelError(f"{name}: the state dict has {got}; expected classifier.weight [{num_classes}, "
                         f"{feature_dim}] (the head Linear(feature_dim, num_classes) named 'classifier')")


def make_model(name: str = "lightcnn", *, in_channels: int, image_size: int, num_classes: int,
               feature_dim: int = 64, seed: int | None = None) -> nn.Module:
    """The one place a device's or the server's model is made: build ``name`` for a data set's
    image shape and class count, then :func:`check_model` it.

    Args:
        name: zoo name or ``"package.module:function"``.
        in_channels, image_size: the data set's image shape ``[C, S, S]``.
        num_classes: the data set's class count.
        feature_dim: the agreed prototype width d (``[model] feature_dim``, ``--feature-dim``).
        seed: when given, ``torch.manual_seed(seed)`` right before construction (the same
            initial weights for the same seed).

    Returns:
        The model; BatchNorm layers with a momentum lose their int64 ``num_batches_tracked``
        counter (:func:`~edge_agent.models.training.drop_batch_counters`).

    Raises:
        ModelError: as :func:`build_model` and :func:`check_model`.
    """
    if seed is not None:
        torch.manual_seed(seed)
    model = build_model(name, in_channels=in_channels, image_size=image_size, num_classes=num_classes,
                        feature_dim=feature_dim)
    drop_batch_counters(model)  # an all-float32 state (a user's BatchNorm layers too)
    check_model(model, in_channels=in_channels, image_size=image_size, num_classes=num_classes,
                feature_dim=feature_dim, name=f"model {name!r}")
    return model

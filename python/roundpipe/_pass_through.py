"""Attribute pass-through to the wrapped (original) model."""


class PassThroughToModel:
    """Attributes the wrapper lacks are read from the original model (the one
    ``set_original_model`` named, else ``self._model``: ``config``,
    ``vocab_size``, ``save_pretrained``...), then from the wrapped model;
    writes of public attributes (new ones too) and deletes go to both."""

    def _targets(self) -> list:
        targets = []
        for key in ("_original", "_model"):
            model = self.__dict__.get(key)
            if model is not None and all(model is not t for t in targets):
                targets.append(model)
        return targets

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        for model in self._targets():
            try:
                return getattr(model, name)
            except AttributeError:
                pass
        raise AttributeError(f"{type(self).__name__} (and the model it wraps) has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        # Public attributes go to the models too, new ones included, as in
        # the original; the wrapper's own properties stay its own.
        if not name.startswith("_") and not hasattr(type(self), name):
            for model in self._targets():
                setattr(model, name, value)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        found = False
        try:
            super().__delattr__(name)  # the wrapper's own (nn.Module's registries too)
            found = True
        except AttributeError:
            pass
        if not name.startswith("_"):
            for model in self._targets():
                if hasattr(model, name):
                    delattr(model, name)
                    found = True
        if not found:
            raise AttributeError(name)

"""Attribute pass-through to the wrapped (original) model."""


class PassThroughToModel:
    """Attributes the wrapper lacks are read from ``self._model`` (the
    original model: ``config``, ``vocab_size``, ``save_pretrained``...);
    writes of the original's public attributes go to both."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        model = self.__dict__.get("_model")
        if model is None:
            raise AttributeError(name)
        return getattr(model, name)

    def __setattr__(self, name: str, value) -> None:
        model = self.__dict__.get("_model")
        if model is not None and not name.startswith("_") and hasattr(model, name):
            setattr(model, name, value)
        object.__setattr__(self, name, value)

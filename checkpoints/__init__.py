"""Trained models in and out: ``checkpoints.load(source)`` gives the model, its tokenizer and its data settings.

A SOURCE is a Lightning ``.ckpt`` written by ``lm-zoo fit`` (:mod:`checkpoints.ckpt_read`), a directory written by
``lm-zoo export`` (read by :mod:`checkpoints.export_read`, written by :mod:`checkpoints.export_write`), a Hugging Face
Hub repo id ``owner/name`` (:mod:`checkpoints.hub`, downloaded into the Hugging Face cache) or the short name of a
registered model (:mod:`checkpoints.registry`); :mod:`checkpoints.sources` tells them apart. Exports and Hub repos are
read as JSON, safetensors and tokenizer files only: nothing from them is ever unpickled.
"""

from checkpoints.export_read import LoadedModel, load_export
from checkpoints.sources import from_pretrained, load, registered_directory
from zoo.errors import LMZooError

__all__ = ["LMZooError", "LoadedModel", "from_pretrained", "load", "load_export", "registered_directory"]

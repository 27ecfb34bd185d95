"""Trainer integrations, each an optional extra that imports its framework lazily.

- ``bytecheckpoint.integrations.lightning``: ``BytecheckpointIO``, a Lightning ``CheckpointIO``
  plugin (``pip install bytecheckpoint[lightning]``).
- ``bytecheckpoint.integrations.accelerate``: ``save_state`` / ``load_state`` for a Hugging Face
  ``Accelerator`` (``bytecheckpoint[accelerate]``).
- ``bytecheckpoint.integrations.hf_trainer``: ``BytecheckpointCallback`` for the Hugging Face
  ``Trainer`` (``bytecheckpoint[transformers]``).

They use only the public API (``bytecheckpoint``, ``bytecheckpoint.manager``,
``bytecheckpoint.errors``); docs/guide/integrations/ shows the lines a user adds.
"""

"""Integrations with the trainers users already run; each module needs its framework installed.

- :mod:`checkpointd.integrations.lightning`: ``CheckpointdIO``, a Lightning ``CheckpointIO`` plugin
  (``pip install 'checkpointd[lightning]'``).
- :mod:`checkpointd.integrations.transformers`: ``CheckpointdCallback``, a Hugging Face
  ``TrainerCallback`` (``pip install 'checkpointd[transformers]'``).

``import checkpointd`` imports neither framework; import the module you use.
"""

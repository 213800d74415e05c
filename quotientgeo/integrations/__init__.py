"""Integrations with training frameworks, each in its own module and imported only by users who
need it (``import quotientgeo`` imports none of them, nor the framework):

- :mod:`quotientgeo.integrations.transformers`: geodesic SAM in the Hugging Face ``Trainer``
  (:class:`~quotientgeo.integrations.transformers.SAMTrainer`) and sharpness logged during its
  training (:class:`~quotientgeo.integrations.transformers.SharpnessCallback`); needs the
  ``transformers`` extra.
"""

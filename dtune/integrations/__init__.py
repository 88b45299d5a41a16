"""dtune inside other libraries: :mod:`dtune.integrations.fla` makes dtune a backend of flash-linear-attention's
dispatch (``import dtune.integrations.fla``; it needs fla-core >= 0.6.0, ``pip install "dtune[fla]"``)."""

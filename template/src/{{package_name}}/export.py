"""Export a checkpoint's model weights: a Hugging Face model directory or one torch.save file.

The command `python -m <package>.export`; its code and usage are in `tools/export.py`."""

from .tools.export import main

if __name__ == "__main__":
    raise SystemExit(main())

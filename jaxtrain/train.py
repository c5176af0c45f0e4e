"""`python -m jaxtrain.train`: the program is jaxtrain/cli/train.py."""
import sys

from jaxtrain.cli.train import main

if __name__ == "__main__":
    sys.exit(main())

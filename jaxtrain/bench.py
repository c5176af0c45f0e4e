"""`python -m jaxtrain.bench`: the program is jaxtrain/cli/bench.py."""
import sys

from jaxtrain.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())

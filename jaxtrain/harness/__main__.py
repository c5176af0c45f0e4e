"""`python -m jaxtrain.harness run --model jaxtrain ...`: the program is jaxtrain/cli/harness.py."""
from jaxtrain.cli.harness import main

if __name__ == "__main__":
    main()

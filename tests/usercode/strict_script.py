"""A script whose argparse knows no --hf-token: it rejects the flag and echoes it, token and
all, on stderr ("unrecognized arguments: --hf-token hf_..."), exit 2."""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=1)
parser.parse_args()

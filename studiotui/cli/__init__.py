"""The command line: the only argparse and console code."""

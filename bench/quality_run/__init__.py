"""bench/quality.py's stages, a module each; the script holds the command line and runs the stages in order."""

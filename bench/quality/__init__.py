"""The quality run (`python3 -m bench.quality`, README.md beside this file): its stages, a module each;
__main__.py holds the command line and runs the stages in order."""

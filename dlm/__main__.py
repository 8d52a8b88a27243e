from dlm.cli import entry

entry()

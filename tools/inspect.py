"""`python -m tools.inspect`, kept for existing scripts: the inspector is `rftpipe.inspect`
(`rftpipe inspect RUN ...`, or `python -m rftpipe.inspect RUN ...`)."""

from rftpipe.inspect.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

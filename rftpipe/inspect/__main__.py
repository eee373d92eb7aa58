"""`python -m rftpipe.inspect`: the same as `rftpipe inspect`."""

from rftpipe.inspect.cli import main

raise SystemExit(main())

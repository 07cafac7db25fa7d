#!/usr/bin/env python
from controlplane.manage import main

if __name__ == "__main__":
    main()

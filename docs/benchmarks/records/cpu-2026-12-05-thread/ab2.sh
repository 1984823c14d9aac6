#!/bin/bash
# Usage: ab2.sh OLD_PARENT_DIR: ab.sh's runs of 1P+1D only, twice each.
exec "$(dirname "$0")/ab.sh" "$1" 1P+1D 1P+1D

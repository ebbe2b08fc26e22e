// What `wsync --version` says of the build: the commit, written at build time
// (scripts/build/build_info.cmake writes build_info.c in the build tree).
#pragma once

/// The commit the sources were built from: 12 hex digits, "-dirty" appended
/// when tracked files differed from it, or "unknown" outside a git checkout.
extern const char ws_build_commit[];

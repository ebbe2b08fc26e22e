# Writes OUTPUT, a C file holding the commit the sources are built from:
# `git rev-parse` in SOURCE_DIR when it is the top of a git checkout (with
# "-dirty" when tracked files differ from that commit), "unknown" otherwise
# (a source archive, no git). It is rewritten only when its text changes, so
# a build recompiles it only then. Run at every build:
#   cmake -DSOURCE_DIR=... -DOUTPUT=... [-DGIT=...] -P build_info.cmake
set(commit "unknown")
if(GIT)
  execute_process(COMMAND ${GIT} -C ${SOURCE_DIR} rev-parse --show-toplevel
    OUTPUT_VARIABLE top RESULT_VARIABLE status OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(status EQUAL 0)
    get_filename_component(top "${top}" REALPATH)
    get_filename_component(source "${SOURCE_DIR}" REALPATH)
  endif()
  # (Only this checkout's commit: a source tree unpacked inside another
  # repository is not that repository's commit.)
  if(status EQUAL 0 AND top STREQUAL source)
    execute_process(COMMAND ${GIT} -C ${SOURCE_DIR} rev-parse --short=12 HEAD
      OUTPUT_VARIABLE head RESULT_VARIABLE status OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(status EQUAL 0 AND NOT head STREQUAL "")
      set(commit "${head}")
      execute_process(COMMAND ${GIT} -C ${SOURCE_DIR} status --porcelain --untracked-files=no
        OUTPUT_VARIABLE changes RESULT_VARIABLE status ERROR_QUIET)
      if(status EQUAL 0 AND NOT changes STREQUAL "")
        set(commit "${commit}-dirty")
      endif()
    endif()
  endif()
endif()
set(text "// Written by scripts/build/build_info.cmake at build time.\n#include \"build_info.h\"\n\nconst char ws_build_commit[] = \"${commit}\";\n")
set(old "")
if(EXISTS "${OUTPUT}")
  file(READ "${OUTPUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUTPUT}" "${text}")
endif()

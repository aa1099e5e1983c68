# Compiler-side settings shared by every target: compile cache, linker, sanitizers, warnings.

find_program(DTUNE_CCACHE ccache)
if(DTUNE_CCACHE)
  set(CMAKE_CXX_COMPILER_LAUNCHER "${DTUNE_CCACHE}")
  set(CMAKE_CUDA_COMPILER_LAUNCHER "${DTUNE_CCACHE}")
endif()

# The default ld.bfd takes tens of seconds per libtorch link on two cores; lld or gold take a few.
include(CheckLinkerFlag)
check_linker_flag(CXX "-fuse-ld=lld" DTUNE_HAS_LLD)
if(DTUNE_HAS_LLD)
  add_link_options("-fuse-ld=lld")
else()
  check_linker_flag(CXX "-fuse-ld=gold" DTUNE_HAS_GOLD)
  if(DTUNE_HAS_GOLD)
    add_link_options("-fuse-ld=gold")
  endif()
endif()

if(DTUNE_SANITIZE)
  add_compile_options("-fsanitize=${DTUNE_SANITIZE}" -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options("-fsanitize=${DTUNE_SANITIZE}")
endif()

# Warnings apply to our own targets only (third-party headers come in as SYSTEM includes).
function(dtune_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)
  # GCC 12's -O3 inlining of std::string appends reports memcpy bounds past PTRDIFF_MAX that no
  # path reaches (GCC bug 105329 and relatives): five such warnings in the release build, none at
  # the dev preset's -O1, where the checks stay on.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12)
    target_compile_options(${target} PRIVATE $<$<CONFIG:Release>:-Wno-stringop-overflow>
      $<$<CONFIG:Release>:-Wno-restrict> $<$<CONFIG:Release>:-Wno-array-bounds>)
  endif()
endfunction()

# "Dev": light optimisation keeps compile time low while libtorch-heavy tests still run quickly.
set(CMAKE_CXX_FLAGS_DEV "-O1" CACHE STRING "Flags for the Dev build type")
set(CMAKE_EXE_LINKER_FLAGS_DEV "" CACHE STRING "")
set(CMAKE_SHARED_LINKER_FLAGS_DEV "" CACHE STRING "")

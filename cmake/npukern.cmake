# CMake snippet for npukern: include() it, or copy it into your project.
#
#   set(NPUKERN_ROOT /path/to/npukern)   # the repository (or an install prefix
#                                        # with include/ and lib/)
#   include(${NPUKERN_ROOT}/cmake/npukern.cmake)
#   target_link_libraries(my_adapter PRIVATE npukern::shared)   # or npukern::static
#
# Build the libraries first: `cargo build --release` (NPUKERN_LIBDIR
# defaults to ${NPUKERN_ROOT}/target/release, else ${NPUKERN_ROOT}/lib).

if(NOT DEFINED NPUKERN_ROOT)
  get_filename_component(NPUKERN_ROOT "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
endif()
if(NOT DEFINED NPUKERN_LIBDIR)
  if(EXISTS "${NPUKERN_ROOT}/target/release/libnpukern.a")
    set(NPUKERN_LIBDIR "${NPUKERN_ROOT}/target/release")
  else()
    set(NPUKERN_LIBDIR "${NPUKERN_ROOT}/lib")
  endif()
endif()

find_package(Threads REQUIRED)

if(NOT TARGET npukern::static)
  add_library(npukern::static STATIC IMPORTED)
  set_target_properties(npukern::static PROPERTIES
    IMPORTED_LOCATION "${NPUKERN_LIBDIR}/libnpukern.a"
    INTERFACE_INCLUDE_DIRECTORIES "${NPUKERN_ROOT}/include"
    # What the Rust standard library inside the archive needs from the system.
    INTERFACE_LINK_LIBRARIES "Threads::Threads;gcc_s;util;rt;m;dl")
endif()

if(NOT TARGET npukern::shared)
  add_library(npukern::shared SHARED IMPORTED)
  set_target_properties(npukern::shared PROPERTIES
    IMPORTED_LOCATION "${NPUKERN_LIBDIR}/libnpukern.so"
    # The library has no SONAME: executables record "libnpukern.so".
    IMPORTED_NO_SONAME TRUE
    INTERFACE_INCLUDE_DIRECTORIES "${NPUKERN_ROOT}/include")
endif()

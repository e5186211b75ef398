# Debian packages, one per install() component, built by CPack's DEB generator:
#   ./setup.sh package      (configure with -DCMAKE_INSTALL_PREFIX=/usr, build, cpack)
# or, in a build configured with /usr:  cpack --config <build>/CPackConfig.cmake
# The .deb files land in <build>/packages/:
#   component daemon -> gradsyncd         /usr/sbin/gradsyncd, /usr/bin/gradsyncctl, the systemd
#                                         unit, sysusers.d and sysctl.d entries, the flagfile
#                                         /etc/gradsync/gradsyncd.flags (a conffile)
#   component runtime -> libgradsync-c0   libgradsync_c.so.0 (the C ABI, SONAME libgradsync_c.so.0)
#   component dev    -> libgradsync-dev   the libgradsync_c.so link, gradsync.h, gradsync.pc
#   component python -> python3-gradsync  /usr/lib/python3/dist-packages/gradsync, with its own
#                                         copy of libgradsync_c.so, which it loads with ctypes
# The version is the project's (project(VERSION) in the top CMakeLists.txt) with Debian
# revision GRADSYNC_DEB_RELEASE. Control files come from deploy/debian/ (configured into
# <build>/deploy/debian/ by deploy/CMakeLists.txt); Depends: come from dpkg-shlibdeps.
#
# Included before the subdirectories: an install() rule that names no component (gradsyncd's
# in daemon/) belongs to the daemon package.
set(CMAKE_INSTALL_DEFAULT_COMPONENT_NAME daemon)

set(GRADSYNC_DEB_RELEASE 1 CACHE STRING "Debian revision of the gradsync packages")
set(GRADSYNC_DEB_VERSION "${PROJECT_VERSION}-${GRADSYNC_DEB_RELEASE}")
set(gradsync_maintainer
    "gradsync maintainers <maintainers@users.noreply.a-seed-ae73c274.example>")
set(gradsync_deb_control ${CMAKE_BINARY_DIR}/deploy/debian)

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME gradsync)
set(CPACK_PACKAGE_VENDOR "gradsync")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "${gradsync_maintainer}")
set(CPACK_PACKAGE_DIRECTORY ${CMAKE_BINARY_DIR}/packages)
set(CPACK_COMPONENTS_ALL daemon runtime dev python)
set(CPACK_DEB_COMPONENT_INSTALL ON)
# The unit, the flagfile and the sysusers.d/sysctl.d entries have absolute destinations.
set(CPACK_SET_DESTDIR ON)
set(CPACK_PACKAGING_INSTALL_PREFIX ${CMAKE_INSTALL_PREFIX})
set(CPACK_STRIP_FILES ON)

set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_RELEASE ${GRADSYNC_DEB_RELEASE})
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${gradsync_maintainer}")
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_DEBIAN_COMPRESSION_TYPE xz)

set(CPACK_DEBIAN_DAEMON_PACKAGE_NAME gradsyncd)
set(CPACK_DEBIAN_DAEMON_PACKAGE_SECTION net)
# The postinst creates the gradsync user with systemd-sysusers, else with adduser.
set(CPACK_DEBIAN_DAEMON_PACKAGE_DEPENDS "adduser")
set(CPACK_DEBIAN_DAEMON_PACKAGE_RECOMMENDS "systemd")
set(CPACK_DEBIAN_DAEMON_DESCRIPTION "per-node gradient-synchronisation daemon
gradsyncd runs the collectives (all-reduce, broadcast, all-gather,
reduce-scatter) of the training processes on its node, over shared memory on
the host and NCCL on GPUs, and with the daemons of other nodes. It hosts the
job's rendezvous store; gradsyncctl inspects it.
This package holds the daemon, gradsyncctl, the systemd unit (enabled and
started on installation), the gradsync system user and the flagfile
/etc/gradsync/gradsyncd.flags.")
set(CPACK_DEBIAN_DAEMON_PACKAGE_CONTROL_EXTRA
    ${gradsync_deb_control}/gradsyncd/conffiles ${gradsync_deb_control}/gradsyncd/postinst
    ${gradsync_deb_control}/gradsyncd/prerm ${gradsync_deb_control}/gradsyncd/postrm)

set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME libgradsync-c0)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_RUNTIME_DESCRIPTION "gradsync client library for C
The C ABI of gradsync (libgradsync_c.so.0): C and C++ training programs use it
to reach the local gradsyncd (sessions, shared-memory and CUDA buffers,
collectives and the job's store).")
# Its shlibs file (programs that link it depend on this version or later; written by
# deploy/, since CPack's own would also describe python3-gradsync's private copy) and the
# ldconfig trigger (CPack also adds postinst and postrm calling ldconfig, redundant but harmless).
set(CPACK_DEBIAN_RUNTIME_PACKAGE_CONTROL_EXTRA
    ${gradsync_deb_control}/libgradsync-c0/shlibs
    ${CMAKE_SOURCE_DIR}/deploy/debian/libgradsync-c0/triggers)

set(CPACK_DEBIAN_DEV_PACKAGE_NAME libgradsync-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "libgradsync-c0 (= ${GRADSYNC_DEB_VERSION})")
set(CPACK_DEBIAN_DEV_DESCRIPTION "gradsync client library for C (development files)
The C ABI of gradsync (gradsync.h) and the libgradsync_c.so link, which C and
C++ training programs build against to reach the local gradsyncd: sessions,
shared-memory and CUDA buffers, collectives and the job's store.
`pkg-config --cflags --libs gradsync` gives the flags.")

set(CPACK_DEBIAN_PYTHON_PACKAGE_NAME python3-gradsync)
set(CPACK_DEBIAN_PYTHON_PACKAGE_SECTION python)
set(CPACK_DEBIAN_PYTHON_PACKAGE_DEPENDS "python3 (>= 3.9)")
set(CPACK_DEBIAN_PYTHON_PACKAGE_RECOMMENDS "gradsyncd")
set(CPACK_DEBIAN_PYTHON_PACKAGE_SUGGESTS "python3-torch")
set(CPACK_DEBIAN_PYTHON_DESCRIPTION "gradsync client for Python
The gradsync package: training processes reach the local gradsyncd through it
(collectives over shared-memory and CUDA buffers, the job's store), and
gradsync.torch wraps a PyTorch optimizer as a distributed one. Pure Python
over the C ABI, loaded with ctypes from the package's own copy of
libgradsync_c.so; torch is needed only for gradsync.torch.")
set(CPACK_DEBIAN_PYTHON_PACKAGE_CONTROL_EXTRA ${gradsync_deb_control}/python3-gradsync/postinst
    ${gradsync_deb_control}/python3-gradsync/prerm)

# Each package's /usr/share/doc/<package>: copyright and changelog.Debian.gz, which Debian
# requires. Component installs only (what CPack does): not part of a plain `cmake --install`.
configure_file(${CMAKE_SOURCE_DIR}/deploy/debian/changelog.in
               ${CMAKE_BINARY_DIR}/deploy/debian/changelog.Debian @ONLY)
execute_process(COMMAND gzip -9nf ${CMAKE_BINARY_DIR}/deploy/debian/changelog.Debian
                RESULT_VARIABLE gradsync_gzip_rc)
if(NOT gradsync_gzip_rc EQUAL 0)
  message(FATAL_ERROR "Packaging: gzip of deploy/debian/changelog.Debian failed")
endif()
foreach(pair IN ITEMS daemon:gradsyncd runtime:libgradsync-c0 dev:libgradsync-dev
                       python:python3-gradsync)
  string(REPLACE ":" ";" pair "${pair}")
  list(GET pair 0 component)
  list(GET pair 1 package)
  install(FILES ${CMAKE_SOURCE_DIR}/deploy/debian/copyright
                ${CMAKE_BINARY_DIR}/deploy/debian/changelog.Debian.gz
          DESTINATION ${CMAKE_INSTALL_DATAROOTDIR}/doc/${package}
          COMPONENT ${component} EXCLUDE_FROM_ALL)
endforeach()

# A Debian package installs under /usr: with another prefix there is no CPack configuration.
if(CMAKE_INSTALL_PREFIX STREQUAL "/usr")
  include(CPack)
else()
  message(STATUS "gradsync: no Debian packages with CMAKE_INSTALL_PREFIX=${CMAKE_INSTALL_PREFIX} "
                 "(they need /usr: ./setup.sh package)")
endif()

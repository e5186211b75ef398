# cmake -DTARGET=t -DFILES=a|b -DALLOWED=dir|dir -DSTAMP=f -P check_layer.cmake
# Fails when one of FILES includes a header of the project ("daemon/...", "client/...",
# "common/...", "net/...", "tests/...", "bench/...") from a folder that is not in ALLOWED: the
# folders of TARGET and of the libraries it links. See daemon/CMakeLists.txt.
cmake_minimum_required(VERSION 3.25)
set(project_tops daemon client common net tests bench)
string(REPLACE "|" ";" FILES "${FILES}")
string(REPLACE "|" ";" ALLOWED "${ALLOWED}")
set(errors "")
foreach(file IN LISTS FILES)
  file(STRINGS "${file}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*$" "\\1" header "${line}")
    string(REGEX MATCH "^[^/]+" top "${header}")
    if(NOT top IN_LIST project_tops)
      continue()
    endif()
    get_filename_component(dir "${header}" DIRECTORY)
    if(NOT dir IN_LIST ALLOWED)
      string(APPEND errors "\n  ${file}: includes \"${header}\"")
    endif()
  endforeach()
endforeach()
if(errors)
  string(REPLACE ";" ", " allowed_text "${ALLOWED}")
  message(FATAL_ERROR "${TARGET} may include only headers of ${allowed_text} (its own folder and "
                      "what it links):${errors}")
endif()
file(WRITE "${STAMP}" "")

#pragma once

// Manual pages (roff, man(7) macros) of the project's programs, rendered from their own flag
// definitions and usage text (gradsyncd --print_config=man, gradsyncctl --print_man), so that
// they cannot drift from the binaries.

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace gradsync {

struct ManPage {
  struct Option {
    std::string name;  // without the dashes
    std::string default_value;
    std::string help;
  };
  struct Command {
    std::string usage;  // "store get KEY"
    std::string help;
  };
  struct Section {
    std::string title;  // an .SS heading under OPTIONS ("" for none)
    std::string text;   // a paragraph before its options
    std::vector<Command> commands;
    std::vector<Option> options;
  };
  std::string name;         // "gradsyncd"
  int section = 8;          // 1: user commands, 8: system administration
  std::string summary;      // the NAME line's, after the dash
  std::string synopsis;     // plain text; each line one form
  std::string description;  // paragraphs separated by blank lines
  std::vector<Section> options;
  std::vector<std::pair<std::string, std::string>> extra;  // further .SH sections: title, text
};

/// `text` escaped for roff: backslashes, hyphens as \-, a leading '.' or '\'' made literal.
std::string RoffEscape(absl::string_view text);

/// The page, titled with the project's version.
std::string RenderManPage(const ManPage& page);

}  // namespace gradsync

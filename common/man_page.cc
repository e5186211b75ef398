// Implementation of man_page.h.

#include "common/man_page.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/version.h"

namespace gradsync {
namespace {

// Paragraphs (split at blank lines) as .PP blocks, each line escaped.
std::string Paragraphs(absl::string_view text) {
  std::string out;
  for (absl::string_view para : absl::StrSplit(text, "\n\n", absl::SkipWhitespace())) {
    absl::StrAppend(&out, ".PP\n");
    for (absl::string_view line : absl::StrSplit(para, '\n', absl::SkipWhitespace())) {
      absl::StrAppend(&out, RoffEscape(absl::StripAsciiWhitespace(line)), "\n");
    }
  }
  return out;
}

}  // namespace

std::string RoffEscape(absl::string_view text) {
  std::string out;
  out.reserve(text.size() + 8);
  for (char c : text) {
    if (c == '\\') {
      out += "\\e";
    } else if (c == '-') {
      out += "\\-";
    } else {
      out += c;
    }
  }
  if (!out.empty() && (out[0] == '.' || out[0] == '\'')) out.insert(0, "\\&");
  return out;
}

std::string RenderManPage(const ManPage& page) {
  std::string upper = absl::AsciiStrToUpper(page.name);
  std::string out = absl::StrCat(
      ".\\\" Generated from the program's own flag definitions; do not edit.\n", ".TH ", upper, " ",
      page.section, " \"\" \"gradsync ", GRADSYNC_VERSION, "\" \"",
      page.section == 8 ? "System Administration" : "User Commands", "\"\n", ".SH NAME\n",
      RoffEscape(page.name), " \\- ", RoffEscape(page.summary), "\n", ".SH SYNOPSIS\n", ".nf\n");
  for (absl::string_view line : absl::StrSplit(page.synopsis, '\n', absl::SkipEmpty())) {
    absl::StrAppend(&out, RoffEscape(line), "\n");
  }
  absl::StrAppend(&out, ".fi\n.SH DESCRIPTION\n", Paragraphs(page.description), ".SH OPTIONS\n");
  for (const ManPage::Section& s : page.options) {
    if (!s.title.empty()) absl::StrAppend(&out, ".SS ", RoffEscape(s.title), "\n");
    if (!s.text.empty()) absl::StrAppend(&out, Paragraphs(s.text));
    for (const ManPage::Command& c : s.commands) {
      absl::StrAppend(&out, ".TP\n\\fB", RoffEscape(c.usage), "\\fR\n", RoffEscape(c.help), "\n");
    }
    for (const ManPage::Option& o : s.options) {
      absl::StrAppend(&out, ".TP\n\\fB\\-\\-", RoffEscape(o.name), "\\fR=\\fI",
                      RoffEscape(o.default_value.empty() ? "\"\"" : o.default_value), "\\fR\n",
                      RoffEscape(o.help), "\n");
    }
  }
  for (const auto& [title, text] : page.extra) {
    absl::StrAppend(&out, ".SH ", RoffEscape(absl::AsciiStrToUpper(title)), "\n", Paragraphs(text));
  }
  return out;
}

}  // namespace gradsync

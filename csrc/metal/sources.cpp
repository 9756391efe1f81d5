// The MSL sources embedded in the binary (docs/architecture.md, 'The Metal backend'): metal_sources.h is generated at build
// time by cmake/embed_metal.cmake from metal/*.metal, so the list of libraries and their texts
// have one origin, the files. Portable: compiled and tested on every platform; the Objective-C++
// layer (device.mm) compiles these sources with newLibraryWithSource at first use.
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include "metal/dispatch.h"
#include "metal_sources.h"  // generated into the build tree

namespace krnl::metal {

const std::vector<std::string>& library_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& l : embedded::libraries) v.emplace_back(l.name);
    return v;
  }();
  return names;
}

std::string library_source(const std::string& name) {
  const embedded::Library* l = embedded::find_library(name.c_str());
  if (!l) {
    std::string known;
    for (const auto& n : library_names()) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("[metal] no library '" + name + "' embedded (metal/*.metal: " + known + ")");
  }
  std::string s;
  s.reserve(l->bytes);
  for (size_t i = 0; i < l->count; ++i) s += l->chunks[i];
  return s;
}

uint32_t library_msl_version(const std::string& name) {
  // The embedded text starts with the file's own first line (quoted includes are inlined later).
  const std::string src = library_source(name);
  const std::string first = src.substr(0, src.find('\n'));
  // `// msl: X.Y`, then the end of the line or a space and a comment: tools/mslsim/dialect's rule.
  static const std::regex version(R"(// msl: (\d+)\.(\d+)(\s.*)?)");
  std::smatch m;
  if (!std::regex_match(first, m, version))
    throw std::logic_error("[metal] metal/" + name + ".metal:1: the first line must declare the MSL version "
                           "as '// msl: X.Y', found '" + first.substr(0, 60) + "'");
  return uint32_t(std::stoul(m[1].str())) * 100 + uint32_t(std::stoul(m[2].str()));
}

}  // namespace krnl::metal

// The MSL sources embedded in the binary (DESIGN section 7): metal_sources.h is generated at build
// time by cmake/embed_metal.cmake from metal/*.metal, so the list of libraries and their texts
// have one origin, the files. Portable: compiled and tested on every platform; the Objective-C++
// layer (device.mm) compiles these sources with newLibraryWithSource at first use.
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

}  // namespace krnl::metal

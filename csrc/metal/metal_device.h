// The "metal" device (csrc/metal/device.mm, macOS only): portable declaration, so that module
// code can call it without any Objective-C type in sight. Built and called only where CMake
// defines KRNL_HAS_METAL (Apple platforms).
#pragma once

namespace krnl::metal {

// Registers "metal" (priority 100: above "cpu", so the default device) when
// MTLCreateSystemDefaultDevice() returns a GPU; does nothing on a machine without one.
void register_metal_backend();

}  // namespace krnl::metal

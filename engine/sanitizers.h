// MHA_TSAN: defined when this file is compiled with ThreadSanitizer, by gcc
// (__SANITIZE_THREAD__) or by clang (__has_feature).
#ifndef MHA_ENGINE_SANITIZERS_H_
#define MHA_ENGINE_SANITIZERS_H_

#if defined(__SANITIZE_THREAD__)
#define MHA_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MHA_TSAN 1
#endif
#endif

#endif  // MHA_ENGINE_SANITIZERS_H_

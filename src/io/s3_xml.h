// Just enough XML for S3's responses (ListObjectsV2, errors, multipart): the inner text of
// elements by tag name, entity-decoded. S3 bodies are flat and machine-written, so no DOM needed.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace dtune::io::s3xml {

// Inner text of every <tag>...</tag> in document order (raw, not decoded).
std::vector<std::string_view> all(std::string_view xml, std::string_view tag);
// Decoded inner text of the first <tag>, or "" when absent.
std::string first(std::string_view xml, std::string_view tag);
// &amp; &lt; &gt; &quot; &apos; &#N; &#xN; -> characters (UTF-8).
std::string decode(std::string_view text);
// The reverse, for the bodies we send.
std::string escape(std::string_view text);

}  // namespace dtune::io::s3xml

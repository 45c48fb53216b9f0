-- Leaf's segment table, as github.com/Meituan-Dianping/Leaf creates it:
-- scripts/leaf_alloc.sql (commit 86a6441d263497b9f9ee321de13422b9c63f0c06), its DROP TABLE left out.
-- tests/test_import.py makes it in a fresh MariaDB database to import from.
CREATE TABLE `leaf_alloc` (
  `biz_tag` varchar(128)  NOT NULL DEFAULT '',
  `max_id` bigint(20) NOT NULL DEFAULT '1',
  `step` int(11) NOT NULL,
  `description` varchar(256)  DEFAULT NULL,
  `update_time` timestamp NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP,
  PRIMARY KEY (`biz_tag`)
) ENGINE=InnoDB;
